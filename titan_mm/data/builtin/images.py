"""Built-in image datasets: scikit-learn digits (chat captioning, easy to score) and scikit-image photos."""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
from PIL import Image

DIGIT_QUESTION = "What digit is this?"
DIGIT_SIZE = 64  # the 8x8 digits are upscaled 8x (nearest) to 64x64 RGB


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def digit_image(x8x8: np.ndarray) -> np.ndarray:
    """8x8 values in [0, 16] -> 64x64x3 uint8, dark digit on a white background."""
    g = (255 - np.clip(x8x8, 0, 16) * (255 / 16)).astype(np.uint8)
    g = np.kron(g, np.ones((DIGIT_SIZE // 8, DIGIT_SIZE // 8), dtype=np.uint8))
    return np.stack([g, g, g], axis=-1)


@lru_cache(maxsize=1)
def digits_data() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images [1797, 8, 8] in [0, 16] and their labels [1797]."""
    from sklearn.datasets import load_digits  # scikit-learn takes seconds to import; only builtin:digits needs it

    d = load_digits()
    return d.images, d.target


def digits_records(test: bool = False) -> list[dict]:
    """Chats "<image> What digit is this?" -> "7". Held out: index % 5 == 0 (360 images); train: the
    other 1437. Each record also has ``answer`` (the digit as a string) and ``index`` (in load_digits),
    so an evaluator can prompt with the user turn only and compare the greedy answer to ``answer``."""
    images, target = digits_data()
    out = []
    for i in range(len(target)):
        if (i % 5 == 0) != test:
            continue
        ans = str(int(target[i]))
        out.append({
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": png(digit_image(images[i]))},
                                             {"type": "text", "text": DIGIT_QUESTION}]},
                {"role": "assistant", "content": [{"type": "text", "text": ans}]},
            ],
            "answer": ans,
            "index": i,
        })
    return out


PHOTOS = {
    "astronaut": "A portrait of an astronaut in a white spacesuit in front of an American flag.",
    "coffee": "A cup of coffee on a saucer, seen from above.",
    "chelsea": "A ginger tabby cat looking to the side.",
    "rocket": "A rocket standing on its launch pad under a blue sky.",
    "immunohistochemistry": "A microscope image of stained tissue cells in brown and blue.",
    "colorwheel": "A color wheel showing a smooth rainbow of hues.",
    "camera": "A black and white photo of a man with a camera on a tripod.",
    "coins": "A grey photo of old coins lying on a dark surface.",
}


def photo_records() -> list[dict]:
    """A few real photos from scikit-image's data module with one-sentence captions."""
    import skimage.data as skd  # scikit-image takes seconds to import; only builtin:photos needs it

    out = []
    for name, caption in PHOTOS.items():
        img = getattr(skd, name)()
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        out.append({
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": png(img[..., :3].astype(np.uint8))},
                                             {"type": "text", "text": "Describe this image."}]},
                {"role": "assistant", "content": caption},
            ],
            "name": name,
        })
    return out
