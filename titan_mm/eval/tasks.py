"""Generation tasks: prompts with references and a metric, run through the serving engine.

A task is a name from ``[eval] tasks``: ``digits`` (the built-in held-out digit images, VL families), ``qa`` (the
built-in held-out text QA), ``dtmf`` / ``dtmf_digits`` (the built-in held-out key tones, alone or with a digit
image, Omni families; the whole answer must match), or a JSONL file, one ``{"messages": [...], "reference": "..."}`` or
``{"prompt": "raw text", "reference": "..."}`` per line (``answer`` is read as ``reference`` too). A file is scored
by exact match, or by ``FILE.jsonl|pkg.module:function`` with function(prediction, reference) -> float. Messages
are rendered by the family's chat template and end with the assistant turn opened; a raw prompt is tokenized as is.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from titan_mm.config import ConfigError
from titan_mm.data.builtin import builtin_records

# name -> (built-in source, metric name)
BUILTIN = {"digits": ("digits_test", "accuracy"), "qa": ("qa_test", "exact_match"), "dtmf": ("dtmf_test", "accuracy"),
           "dtmf_digits": ("dtmf_digits_test", "accuracy"), "dtmf_seq": ("dtmf_seq_test", "accuracy")}


def exact_match(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


@dataclass
class Task:
    name: str
    """The metric prefix: eval/<name>/<metric>."""
    metric_name: str
    metric: Callable[[str, str], float]
    items: list[dict]
    """{"messages": [...] | "prompt": str, "reference": str}, in file order."""

    @property
    def media(self) -> set[str]:
        """The media kinds ("image", "video", "audio") its prompts' message parts carry."""
        return {p["type"] for it in self.items for m in it.get("messages", ()) if isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") in ("image", "video", "audio")}


def _callable(path: str, task: str) -> Callable[[str, str], float]:
    mod, _, fn = path.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"eval.tasks {task!r}: cannot import the metric {path!r} ({e}); give pkg.module:function")
    if not callable(f):
        raise ConfigError(f"eval.tasks {task!r}: {path!r} is not callable")
    return f


def read_jsonl_items(path: Path, task: str, key: str = "eval.tasks") -> list[dict]:
    """{"messages" | "prompt", "reference"} per line of ``path``; ConfigErrors say ``key`` ``task``."""
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key} {task!r}: line {n} is not JSON ({e})") from None
        ref = rec.get("reference", rec.get("answer")) if isinstance(rec, dict) else None
        has = [k for k in ("messages", "prompt") if isinstance(rec, dict) and k in rec]
        if len(has) != 1 or not isinstance(ref, str):
            raise ConfigError(f"{key} {task!r}: line {n} needs one of \"messages\" or \"prompt\" and a string "
                              "\"reference\"")
        items.append({has[0]: rec[has[0]], "reference": ref})
    if not items:
        raise ConfigError(f"{key} {task!r}: {path} holds no prompts")
    return items


def load_task(spec: str, limit: int = 0) -> Task:
    """The task named by one ``[eval] tasks`` entry, its first ``limit`` prompts (0: all)."""
    if spec in BUILTIN:
        name, metric = BUILTIN[spec]
        records = builtin_records(name)
        if limit:  # the dtmf records are made when read: take the first ``limit`` before reading them
            records = records[:limit]
        items = [{"messages": r["messages"][:-1], "reference": r["answer"]} for r in records]
        task = Task(spec, metric, exact_match, items)
    else:
        file, _, fn = spec.partition("|")
        path = Path(file)
        if path.suffix != ".jsonl" or not path.is_file():
            raise ConfigError(f"eval.tasks {spec!r} is not a built-in task ({', '.join(BUILTIN)}) or an existing "
                              ".jsonl file")
        task = Task(path.stem, fn.rpartition(":")[2] if fn else "exact_match",
                    _callable(fn, spec) if fn else exact_match, read_jsonl_items(path, spec))
    if limit:
        task.items = task.items[:limit]
    return task
