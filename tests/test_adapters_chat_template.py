"""Chat templates render exactly as transformers' apply_chat_template does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri_backend.adapters.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    render_chat,
    template_from_tokenizer_config,
)

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Exercises what real templates use: bos_token, loop controls, tojson, raise_exception, whitespace control,
# {% generation %}, and namespace().
FANCY = """{{ bos_token }}
{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('bad role ' + m['role']) }}
  {% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  [{{ ns.n }}] {{ m['role'] }}: {{ m['content'] | tojson }}
  {% if m['role'] == 'assistant' %}
    {% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
  {% endif %}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}[{{ ns.n + 1 }}] assistant:{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Héllo "there" 😀'},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Bye\nnow"},
]


def _reference(template: str, messages: list, **kwargs: object) -> str:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
    )
    tok.chat_template = template
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("template", [SMOLLM2, FANCY])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(template: str, add_generation_prompt: bool) -> None:
    expected = _reference(template, MESSAGES, add_generation_prompt=add_generation_prompt)
    got = ChatTemplate(template, "<s>", "</s>").render(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_tools_are_passed() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    expected = _reference(FANCY, MESSAGES, tools=tools, add_generation_prompt=True)
    assert ChatTemplate(FANCY, "<s>", "</s>").render(MESSAGES, tools=tools) == expected


def test_train_moe_template_matches_transformers() -> None:
    path = Path(__file__).resolve().parent.parent / "tools/train_moe/release/chat_template.jinja"
    template = path.read_text(encoding="utf-8")
    expected = _reference(template, MESSAGES, add_generation_prompt=True)
    assert ChatTemplate(template, "<s>", "</s>").render(MESSAGES) == expected


def test_raise_exception_becomes_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ChatTemplate(FANCY).render([{"role": "tool", "content": "x"}])


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_chat(None, MESSAGES, model_name="tiny")


def test_bad_messages_and_syntax() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(SMOLLM2).render("hello")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(SMOLLM2).render([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_attribute_escapes() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render(MESSAGES)


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": SMOLLM2}))
    assert template_from_tokenizer_config(cfg) == SMOLLM2
    cfg.write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    assert template_from_tokenizer_config(cfg) == "D"
    assert template_from_tokenizer_config(cfg, "tool_use") == "T"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert template_from_tokenizer_config(cfg) == "J"
    assert template_from_tokenizer_config(tmp_path / "missing" / "tokenizer_config.json") is None
