"""Training-inference mismatch corrections: the `correction=` config group (see docs/corrections.md).

Each method is one class in its own module, picked by the ``_target_`` of its YAML in conf/correction/; the
names below are re-exported for convenience only, so a new method does not need to be added here.
"""
from rlmm.corrections.base import METRIC_KEYS, Correction, CorrectionOutput
from rlmm.corrections.bypass import Bypass
from rlmm.corrections.geo_rs import GeometricRejection
from rlmm.corrections.kl_rs import KLRejection
from rlmm.corrections.none import NoCorrection
from rlmm.corrections.seq_mis import SequenceMask
from rlmm.corrections.seq_tis import SequenceTIS
from rlmm.corrections.tis import TokenTIS
from rlmm.corrections.token_mask import TokenMask

__all__ = [
    "METRIC_KEYS",
    "Correction",
    "CorrectionOutput",
    "NoCorrection",
    "Bypass",
    "TokenTIS",
    "SequenceTIS",
    "TokenMask",
    "SequenceMask",
    "GeometricRejection",
    "KLRejection",
]
