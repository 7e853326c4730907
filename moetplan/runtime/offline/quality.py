"""Quality harness: how close 2-bit experts, + FP4 reserve, + confidence gate come to the unquantized model.

A tiny Qwen3-MoE (transformers) is trained for a few hundred CPU steps on local text (Python's own stdlib
sources) with a byte-level BPE tokenizer built here, so its predictions are peaked enough that quantization
errors show. The trained checkpoint is cached (atomic directory rename), keyed by config, steps and corpus.

Variants replace each HF MoE block's expert computation with moetplan's own format + op (`ops.moe_forward` over
2-bit rows from `format.pack_expert_row`, FP4 rows through `reserve.FP4Reserve`), keeping HF's router. All
variants are evaluated teacher-forced, one token per step with a KV cache (so the gate recomputes a real decode
step), against the float model: next-token agreement (argmax) and KL(reference || variant).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moetplan.contract.errors import UsageError
from moetplan.contract.sizing import gate_floor_slots, reserve_slots as cap_reserve, step_working_set
from moetplan.models.tiny import byte_level_bpe, qwen3_moe_config
from moetplan.contract import envs
from moetplan.runtime.format.format import RowLayout, pack_expert_row
from moetplan.runtime.reserve.gate import GateController
from moetplan.runtime.op.ops import moe_forward
from moetplan.runtime.reserve.reserve import FP4Reserve
from moetplan.runtime.reserve.reserve_sources import QuantizingRowSource

# Bump when training or the corpus recipe changes what a cached checkpoint holds.
HARNESS_VERSION = 1

TRAIN_MODULES = ("argparse", "textwrap", "difflib", "csv", "string", "heapq", "bisect", "calendar", "fractions",
                 "statistics", "shlex", "fnmatch", "pprint", "dataclasses", "json.decoder", "json.encoder",
                 "configparser", "gettext", "locale", "optparse")
HELDOUT_MODULES = ("queue", "sched", "colorsys", "graphlib")


# --------------------------------------------------------------------------- corpus and tokenizer


def module_text(names: tuple[str, ...]) -> str:
    """Concatenated source of stdlib modules (public-domain-like text that every Python install has)."""
    parts = []
    for n in names:
        mod = importlib.import_module(n)
        path = getattr(mod, "__file__", None)
        if not path or not path.endswith(".py"):
            raise UsageError(f"stdlib module {n} has no .py source here; pick corpus modules that do")
        parts.append(Path(path).read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def build_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `text` (the tiny models' builder, moetplan.models.tiny)."""
    from tokenizers import pre_tokenizers

    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(specials)
    if vocab_size < floor:
        raise UsageError(f"vocab_size {vocab_size} is below the byte-level floor {floor} (256 bytes + specials); "
                         f"use a vocab of at least {floor}")
    return byte_level_bpe([text[i:i + 4096] for i in range(0, len(text), 4096)], vocab_size, specials)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TinyMoeSpec:
    """The tiny model and its training. Dims are multiples of 32 (block-32 scales)."""

    hidden: int = 128
    moe_inter: int = 128
    experts: int = 16
    top_k: int = 2
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    train_steps: int = 300
    seq_len: int = 128
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0

    def hf_config(self):
        from transformers import Qwen3MoeConfig

        cfg = qwen3_moe_config(hidden=self.hidden, moe_inter=self.moe_inter, experts=self.experts, top_k=self.top_k,
                               layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                               head_dim=self.hidden // self.heads, vocab=self.vocab, output_router_logits=True,
                               router_aux_loss_coef=0.01)
        return Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})


def _fingerprint(spec: TinyMoeSpec, corpus: str) -> str:
    h = hashlib.sha256(json.dumps({**asdict(spec), "v": HARNESS_VERSION}, sort_keys=True).encode())
    h.update(corpus.encode())
    return h.hexdigest()[:16]


def default_cache_root() -> Path:
    env = envs.get(envs.QUALITY_CACHE)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("moetplan")) / "quality"


def train_tiny_moe(spec: TinyMoeSpec, ids: torch.Tensor, log: Callable[[str], None] | None = None):
    """Train from scratch on a 1-D token tensor; returns (model in eval mode, training info)."""
    from transformers import Qwen3MoeForCausalLM

    if ids.numel() < spec.seq_len + 2:
        raise UsageError(f"training text has {ids.numel()} tokens; need more than seq_len={spec.seq_len}")
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(spec.hf_config()).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    warm = max(1, spec.train_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(
        math.pi * min(1.0, max(0, s - warm) / max(1, spec.train_steps - warm))))))
    gen = torch.Generator().manual_seed(spec.seed)
    t0, losses = time.perf_counter(), []
    for step in range(spec.train_steps):
        starts = torch.randint(0, ids.numel() - spec.seq_len - 1, (spec.batch,), generator=gen)
        x = torch.stack([ids[s:s + spec.seq_len] for s in starts.tolist()])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(out.loss.detach()))
        if log and (step % 50 == 0 or step == spec.train_steps - 1):
            log(f"step {step}: loss {losses[-1]:.3f}")
    model.eval()
    tail = losses[-20:]
    return model, {"steps": spec.train_steps, "train_s": time.perf_counter() - t0,
                   "final_loss": sum(tail) / len(tail), "first_loss": losses[0]}


def load_or_train(spec: TinyMoeSpec, cache_root: str | os.PathLike[str] | None = None,
                  log: Callable[[str], None] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info): trained once per (spec, corpus), then read from the cache."""
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeForCausalLM

    corpus = module_text(TRAIN_MODULES)
    root = Path(cache_root) if cache_root else default_cache_root()
    d = root / f"tiny-moe-{_fingerprint(spec, corpus)}"
    if (d / "info.json").is_file():
        model = Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        return model, Tokenizer.from_file(str(d / "tokenizer.json")), json.loads((d / "info.json").read_text())
    tok = build_tokenizer(corpus, spec.vocab)
    ids = torch.tensor(tok.encode(corpus).ids, dtype=torch.long)
    model, info = train_tiny_moe(spec, ids, log)
    info.update(train_tokens=int(ids.numel()), spec=asdict(spec))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "info.json").write_text(json.dumps(info, indent=1))
        try:
            os.replace(tmp, d)  # atomic: a crash leaves a temp dir, never a half-written checkpoint
        except OSError:
            if not (d / "info.json").is_file():  # another process won the race with a complete copy otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tok, info


# --------------------------------------------------------------------------- quantized experts


@dataclass
class VariantState:
    """What the quantized expert modules consult on every call; switch variants by changing it."""

    reserve: FP4Reserve | None = None
    gate: GateController | None = None
    calls: int = 0


class QuantizedExperts(torch.nn.Module):
    """Drop-in for Qwen3MoeExperts: forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, layer: int, pool: torch.Tensor, slot_of: torch.Tensor, layout: RowLayout,
                 state: VariantState):
        super().__init__()
        self.layer, self.pool, self.slot_of, self.layout, self.state = layer, pool, slot_of, layout, state

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        st = self.state
        st.calls += 1
        extra: dict[str, Any] = {}
        if st.gate is not None:
            st.gate.record(self.layer, top_k_index)
        if st.reserve is not None:
            st.reserve.observe(self.layer, top_k_index)
            extra = st.reserve.op_args(self.layer)  # one published row for this whole call
        return moe_forward(hidden_states, top_k_index, top_k_weights, self.pool, self.slot_of, self.layout, **extra)


def expert_weights(model: Any, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) of the float model: HF stores gate_up_proj as [gate; up], our w13 order."""
    ex = model.model.layers[layer].mlp.experts
    return ex.gate_up_proj[expert].detach(), ex.down_proj[expert].detach()


def quantize_model(ref: Any, state: VariantState) -> Any:
    """A copy of `ref` whose routed experts run through moetplan's 2-bit rows (+ whatever `state` adds)."""
    import copy

    cfg = ref.config
    layout = RowLayout.for_expert(cfg.hidden_size, cfg.moe_intermediate_size, 1, "2bit")
    model = copy.deepcopy(ref)
    for l, dec in enumerate(model.model.layers):
        E = cfg.num_experts
        pool = torch.empty((E, layout.stride), dtype=torch.uint8)
        for e in range(E):
            w13, w2 = expert_weights(ref, l, e)
            pack_expert_row(w13, w2, layout, out=pool[e])
        dec.mlp.experts = QuantizedExperts(l, pool, torch.arange(E, dtype=torch.int32), layout, state)
    return model.eval()


def fp4_source(ref: Any) -> QuantizingRowSource:
    cfg = ref.config
    lay = RowLayout.for_expert(cfg.hidden_size, cfg.moe_intermediate_size, 1, "fp4")
    return QuantizingRowSource(lambda l, e: expert_weights(ref, l, e), lay, cfg.num_hidden_layers, cfg.num_experts)


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def decode_logits(model: Any, ids: torch.Tensor, prompt: int, *, gate: GateController | None = None,
                  reserve: FP4Reserve | None = None, maintain: bool = False) -> torch.Tensor:
    """Teacher-forced: prefill `prompt` tokens, then one step per token. Returns float32 logits [N - prompt, V]
    for the positions prompt-1 .. N-2 (each predicting the next token).

    `gate`: each decode step runs through it (prefill never does). `maintain`: after each step, run the
    reserve's promotion rounds inline until idle, for a reproducible run (the server uses the worker thread).
    """
    from transformers import DynamicCache

    ids = ids.reshape(1, -1)
    n = ids.shape[1]
    cache = DynamicCache()
    out = model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True)
    rows = [out.logits[0, -1:].float()]
    for t in range(prompt, n - 1):
        def forward(t: int = t) -> torch.Tensor:
            extra = cache.get_seq_length() - t
            if extra > 0:
                cache.crop(-extra)  # a recompute replaces this step's KV
            pos = torch.tensor([[t]])
            o = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True, position_ids=pos)
            return o.logits[0, -1:].float()

        if gate is not None:
            logits = gate.run_step(forward)
        elif reserve is not None:
            with reserve.step():
                logits = forward()
        else:
            logits = forward()
        rows.append(logits)
        if maintain and reserve is not None:
            while reserve.maintain():
                pass
    return torch.cat(rows, 0)


def compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Next-token agreement (argmax) and mean KL(reference || variant) in nats."""
    if ref_logits.shape != logits.shape:
        raise UsageError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    lp_ref = torch.log_softmax(ref_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {"agreement": float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean()),
            "kl": float(kl.mean()), "positions": int(ref_logits.shape[0])}


@dataclass
class QualityConfig:
    tau: float = 0.3
    reserve_share: float = 0.25  # FP4 reserve rows as a share of all (layer, expert) rows, before the gate's room
    # room for one step's routed working set x this (the planner's fp4_gate.floor_factor, hwdb/guards.yaml)
    gate_floor_factor: float | None = None
    eval_tokens: int = 512
    prompt: int = 16
    warmup_tokens: int = 512  # routing heat gathered on training text before the reserve is filled
    extra: dict[str, Any] = field(default_factory=dict)


def reserve_slots(cfg: Any, q: QualityConfig) -> tuple[int, int]:
    """(slots, max promotions per step): the hot share plus the gate's floor (one step's experts x factor)."""
    if q.gate_floor_factor is None:
        raise UsageError("QualityConfig.gate_floor_factor is not set: pass the planner's fp4_gate.floor_factor "
                         "(hwdb/guards.yaml), so the harness sizes the reserve as a plan would")
    step_set = step_working_set(cfg.num_hidden_layers, cfg.num_experts_per_tok)
    hot = max(1, int(round(q.reserve_share * cfg.num_hidden_layers * cfg.num_experts)))
    slots = hot + gate_floor_slots(step_set, q.gate_floor_factor)
    return cap_reserve(slots, cfg.num_hidden_layers, cfg.num_experts), step_set


def run_quality(model: Any, tok: Any, q: QualityConfig | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The three variants against the float model on held-out stdlib text; a JSON-ready dict."""
    q = q or QualityConfig()
    say = log or (lambda s: None)
    cfg = model.config
    held = torch.tensor(tok.encode(module_text(HELDOUT_MODULES)).ids[: q.eval_tokens + 1], dtype=torch.long)
    warm = torch.tensor(tok.encode(module_text(TRAIN_MODULES[:2])).ids[: q.warmup_tokens], dtype=torch.long)
    if held.numel() <= q.prompt + 1:
        raise UsageError(f"held-out text has only {held.numel()} tokens; lower prompt or pick longer modules")
    slots, step_set = reserve_slots(cfg, q)

    t0 = time.perf_counter()
    ref = decode_logits(model, held, q.prompt)
    res: dict[str, Any] = {"reference_s": time.perf_counter() - t0}

    state = VariantState()
    qmodel = quantize_model(model, state)
    t0 = time.perf_counter()
    two = decode_logits(qmodel, held, q.prompt)
    res["two_bit"] = {**compare(ref, two), "eval_s": time.perf_counter() - t0}
    say(f"2-bit: {res['two_bit']}")

    def warmed_reserve() -> FP4Reserve:
        r = FP4Reserve(fp4_source(model), slots, layout=fp4_source(model).layout, background=False)
        state.reserve, state.gate = r, None
        with torch.no_grad():  # routing heat from a warm-up text, then fill with the hottest rows
            for i in range(0, warm.numel(), 64):
                with r.step():
                    qmodel(input_ids=warm[i:i + 64].reshape(1, -1))
        while r.maintain(max_rows=slots):
            pass
        r.reset_counters()  # report what the evaluation did, not the warm-up
        return r

    r = warmed_reserve()
    t0 = time.perf_counter()
    with_res = decode_logits(qmodel, held, q.prompt, reserve=r, maintain=True)
    res["reserve"] = {**compare(ref, with_res), "eval_s": time.perf_counter() - t0, "reserve": r.stats()}
    say(f"+reserve: {res['reserve']['agreement']:.4f}")

    r = warmed_reserve()
    gate = GateController(r, enabled=True, tau=q.tau, max_promotions_per_step=step_set)
    state.gate = gate
    t0 = time.perf_counter()
    with_gate = decode_logits(qmodel, held, q.prompt, gate=gate, reserve=r, maintain=True)
    res["reserve_gate"] = {**compare(ref, with_gate), "eval_s": time.perf_counter() - t0,
                           "gate": gate.counters(), "reserve": r.stats()}
    say(f"+reserve+gate: {res['reserve_gate']['agreement']:.4f} fires {gate.c.fires}/{gate.c.steps}")
    # The ceiling: every expert at FP4 (what reserve + gate approach as the reserve grows)
    rows = cfg.num_hidden_layers * cfg.num_experts
    src = fp4_source(model)
    r = FP4Reserve(src, rows, layout=src.layout, background=False)
    r.promote_now([(l, e) for l in range(cfg.num_hidden_layers) for e in range(cfg.num_experts)])
    state.reserve, state.gate = r, None
    res["fp4_all"] = compare(ref, decode_logits(qmodel, held, q.prompt, reserve=r))
    say(f"all FP4: {res['fp4_all']['agreement']:.4f}")
    state.gate = state.reserve = None

    a = [res[k]["agreement"] for k in ("two_bit", "reserve", "reserve_gate")]
    res["monotonic"] = bool(a[0] < a[1] < a[2])
    res["setup"] = {"reserve_slots": slots, "expert_rows": cfg.num_hidden_layers * cfg.num_experts,
                    "max_promotions_per_step": step_set, "tau": q.tau, "eval_positions": int(ref.shape[0]),
                    "prompt": q.prompt, "heldout_modules": list(HELDOUT_MODULES),
                    "warmup_tokens": int(warm.numel())}
    return res


__all__ = ["QuantizedExperts", "QualityConfig", "TinyMoeSpec", "VariantState", "compare", "decode_logits",
           "fp4_source", "load_or_train", "quantize_model", "run_quality", "train_tiny_moe"]
