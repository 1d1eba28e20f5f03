"""A task metric for tests/multiproc/test_eval_world2.py: a code of the generated text, so that two runs' mean
scores agree only when (almost surely) every prompt generated the same text."""

import hashlib


def text_code(prediction: str, reference: str) -> float:
    return int(hashlib.sha1(prediction.encode()).hexdigest()[:8], 16) / 2**32
