"""Cost model: decode/prefill step time as named physical terms, routing locality, calibration.

Public API (the solver and the CLI use these names):
    predict(model, hw, placement, calib=None) -> Prediction
    coverage(model, cached_share, calib=None) -> float
    load_calibration(hw=None) -> Calibration
"""
from moetplan.cost_model.calibration import Calibration, load_calibration
from moetplan.cost_model.coverage import coverage
from moetplan.cost_model.predict import predict

__all__ = ["Calibration", "coverage", "load_calibration", "predict"]
