"""`moetplan bench`: measure a served model through its OpenAI-compatible endpoint and write a run record.

    client.py       one streamed request, timed
    phases.py       the bench phases (decode, prefill, TTFT, batch curve, probes), resume, plan defaults
    probes.py       quality probes (needle, arithmetic, coherence)
    render.py       rich tables of a run record
"""
