"""Built-in audio: telephone key tones (DTMF), generated from a seed, nothing downloaded.

Each key sounds as the sum of its keypad row and column sines (ITU-T Q.23): rows 697 / 770 / 852 / 941 Hz,
columns 1209 / 1336 / 1477 Hz over the keys ``1 2 3 / 4 5 6 / 7 8 9 / * 0 #``. Each tone is 60-180 ms, with
40-120 ms gaps between tones, 20-200 ms of silence around them, one level per clip (0.1-0.35 per sine) and white
noise of standard deviation 0-0.05: a 16 kHz mono float32 waveform (0.1-0.6 s for one key, up to 2.1 s for six).

    dtmf / dtmf_test                 one key: "<audio> Which key was pressed?" -> "4"
    dtmf_digits / dtmf_digits_test   one key and a digit image: "<image><audio> Which key was pressed, and what
                                     digit is in the image?" -> "key 4, digit 3" (a scikit-learn digit, as
                                     builtin:digits draws it)
    dtmf_seq / dtmf_seq_test         1-6 keys: "<audio> Which keys were pressed?" -> "4*07"

The one-key variants are what the debug Omni configs learn on 2 CPU cores in minutes; ordered sequences of keys
take the tiny models far longer (the Omni families' pages in docs/).

Record ``i`` of a variant is a pure function of (variant, i): keys, lengths, level and noise come from
``random.Random("<variant>:<i>")`` (the same on every machine and Python version), the noise samples from numpy's
PCG64 seeded by it. Of ``N_RECORDS`` per variant, index % 5 == 0 is held out in the ``_test`` split; the mixed
variant's test split also draws only held-out digit images (builtin:digits_test's). Records carry ``answer``
(the assistant text), ``keys`` and ``index``. Records are made when read (:class:`LazyRecords`): the train
split's audio as float32 is about 90 MB, too much to hold in every loader worker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import partial

import numpy as np

from titan_mm.data.builtin.images import digit_image, digits_data, png

KEYS = "123456789*0#"  # row-major on the keypad
ROW_HZ = (697, 770, 852, 941)
COL_HZ = (1209, 1336, 1477)
RATE = 16000
# variant -> (with a digit image, most keys per clip)
VARIANTS = {"dtmf": (False, 1), "dtmf_digits": (True, 1), "dtmf_seq": (False, 6)}
N_RECORDS = 2000  # per variant, before the train / test split


def key_freqs(key: str) -> tuple[int, int]:
    """(row, column) frequencies in Hz of a keypad key."""
    if len(key) != 1 or key not in KEYS:
        raise ValueError(f"not a DTMF key: {key!r} (keys: {KEYS})")
    i = KEYS.index(key)
    return ROW_HZ[i // 3], COL_HZ[i % 3]


def _seconds(r: random.Random, lo: float, hi: float) -> int:
    return int(r.uniform(lo, hi) * RATE)


def dtmf_clip(keys: str, r: random.Random) -> np.ndarray:
    """The keys as one clip at 16 kHz: silence, tone, gap, tone, ..., silence, plus white noise."""
    level = r.uniform(0.1, 0.35)
    pieces = [np.zeros(_seconds(r, 0.02, 0.2))]
    for j, key in enumerate(keys):
        if j:
            pieces.append(np.zeros(_seconds(r, 0.04, 0.12)))
        t = np.arange(_seconds(r, 0.06, 0.18)) / RATE
        pieces.append(level * sum(np.sin(2 * np.pi * f * t + r.uniform(0, 2 * math.pi)) for f in key_freqs(key)))
    pieces.append(np.zeros(_seconds(r, 0.02, 0.2)))
    wave = np.concatenate(pieces)
    noise = r.uniform(0.0, 0.05) * np.random.default_rng(r.getrandbits(64)).standard_normal(wave.shape[0])
    return (wave + noise).astype(np.float32)


def split(n: int, test: bool) -> list[int]:
    """The indices below ``n`` of the test (index % 5 == 0) or train split, as builtin:digits splits."""
    return [i for i in range(n) if (i % 5 == 0) == test]


def dtmf_record(i: int, variant: str = "dtmf") -> dict:
    """Record ``i`` of a variant (``VARIANTS``)."""
    mixed, max_keys = VARIANTS[variant]
    r = random.Random(f"{variant}:{i}")
    keys = "".join(r.choice(KEYS) for _ in range(r.randint(1, max_keys)))
    clip = {"type": "audio", "audio": dtmf_clip(keys, r)}
    which = "Which keys were pressed" if max_keys > 1 else "Which key was pressed"
    content, answer = [clip, {"type": "text", "text": which + "?"}], keys
    if mixed:
        images, target = digits_data()
        pool = split(len(target), test=i % 5 == 0)
        j = pool[r.randrange(len(pool))]
        content = [{"type": "image", "image": png(digit_image(images[j]))}, clip,
                   {"type": "text", "text": which + ", and what digit is in the image?"}]
        answer = f"{'keys' if max_keys > 1 else 'key'} {keys}, digit {int(target[j])}"
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "answer": answer, "keys": keys, "index": i}


class LazyRecords(Sequence):
    """The records ``make(i)`` for ``i`` in ``index``, each made when read; slicing gives another lazy view."""

    def __init__(self, make, index: Sequence[int]):
        self.make, self.index = make, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return LazyRecords(self.make, self.index[k])
        return self.make(self.index[k])


def dtmf_records(variant: str, test: bool = False) -> LazyRecords:
    """The train (index % 5 != 0) or test (index % 5 == 0) split of a variant."""
    return LazyRecords(partial(dtmf_record, variant=variant), split(N_RECORDS, test))
