"""Evaluating and comparing: accuracy and GFLOPs against native on the same images
(``timm-dora eval``), timing with the paper's protocol (``timm-dora bench``), the baselines DORA is
compared with (:mod:`~timm_dora.evaluate.baselines`: ToMe, PiToMe, MCTF, DiffRate, Representation Shift,
Zero-TPrune, V-Pruner, static schedules, selector substitutions) and accuracy-matched tables (:mod:`~timm_dora.evaluate.matching`).

Library use::

    from timm_dora.evaluate import build_method, evaluate, loader_for
    rows = evaluate(model, [build_method(model, "tome", r=8)], loader_for(model, "labels.csv", "test"))
"""
from .accuracy import Tally, evaluate, format_rows, loader_for, tensor_batches
from .methods import (METHODS, DiffRateMethod, DoraMethod, MCTFMethod, Method, NativeMethod, Output, PiToMeMethod, ReductionMethod,
                      RepShiftMethod, SelectorMethod, StaticMethod, ToMeMethod, VPrunerMethod, ZeroTPruneMethod, build_method,
                      native_forward)
from .setup import PRECISIONS, environment, inference_device, load_model, precision_for, write_json

__all__ = ["METHODS", "PRECISIONS", "DiffRateMethod", "DoraMethod", "MCTFMethod", "Method", "NativeMethod", "Output", "PiToMeMethod",
           "ReductionMethod", "RepShiftMethod", "SelectorMethod", "StaticMethod", "Tally", "ToMeMethod", "VPrunerMethod", "ZeroTPruneMethod",
           "build_method", "environment", "evaluate", "format_rows", "inference_device", "load_model", "loader_for",
           "native_forward", "precision_for", "tensor_batches", "write_json"]
