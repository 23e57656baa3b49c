"""Chat templates: render a conversation to text exactly as `transformers` does.

A converted model keeps its tokenizer's Jinja chat template (`chat_template` in
tokenizer_config.json, or a `chat_template.jinja` file beside it). `render` evaluates it the way
`transformers`' `apply_chat_template` does: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not escape HTML, the
`raise_exception` and `strftime_now` globals, and the tokenizer's special-token strings
(`bos_token`, `eos_token`, ...) as variables. The rendered text already holds every special
token the model expects (e.g. Llama-3's `<|begin_of_text|>`), so it is encoded with no specials
added. tests/test_chat.py checks token-for-token equality with `transformers`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from etils import epath

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str}
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
  """A missing or unusable chat template, or a conversation it cannot render."""


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  import jinja2  # pylint: disable=g-import-not-at-top  (only chat data and chat prompts need it)
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  env = sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ChatTemplateError(
      f"chat template does not parse: {e.message} (line {e.lineno})"
    ) from None


@functools.lru_cache(maxsize=8)
def _read_json(path: str) -> dict[str, Any]:
  return json.loads(epath.Path(path).read_text(encoding="utf-8"))


def _token_string(value: Any) -> str | None:
  return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
  """A tokenizer's chat template with the special-token strings it may refer to."""

  def __init__(self, template: str, special_tokens: dict[str, str], source: str = ""):
    self.template, self.special_tokens, self.source = template, special_tokens, source

  @classmethod
  def from_tokenizer_dir(cls, folder: str) -> "ChatTemplate | None":
    """The template saved with a tokenizer (tokenizer_config.json or chat_template.jinja), or
    None when it has none."""
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_path) if epath.Path(config_path).is_file() else {}
    template, source = config.get("chat_template"), config_path
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    jinja_path = os.path.join(folder, TEMPLATE_FILE)
    if template is None and epath.Path(jinja_path).is_file():
      template, source = epath.Path(jinja_path).read_text(encoding="utf-8"), jinja_path
    if not template:
      return None
    specials = {
      key: _token_string(config[key])
      for key in _SPECIAL_TOKEN_KEYS
      if _token_string(config.get(key)) is not None
    }
    return cls(template, specials, source)

  def render(
    self, messages: Sequence[Message], add_generation_prompt: bool = False, **kwargs: Any
  ) -> str:
    """The conversation as the model sees it; `add_generation_prompt` opens an assistant turn."""
    import jinja2  # pylint: disable=g-import-not-at-top

    for i, message in enumerate(messages):
      if not isinstance(message, dict) or "role" not in message:
        raise ChatTemplateError(f"message {i} is not a {{'role': ..., 'content': ...}} object")
    try:
      return _compile(self.template).render(
        messages=[dict(m) for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **self.special_tokens,
        **kwargs,
      )
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"chat template of {self.source}: {e}") from None


def assistant_spans(template: ChatTemplate, messages: Sequence[Message]) -> tuple[str, list]:
  """The rendered conversation and the [start, end) character spans of its assistant turns.

  A turn's span runs from the end of the conversation before it rendered with the generation
  prompt (where a model's answer starts) to the end of the conversation up to and including it
  (its end-of-turn markup included: the model must learn to stop). Templates that rewrite an
  earlier turn once later turns exist (e.g. Qwen-3 dropping the reasoning of answers before the
  last question) cannot place such a turn; that raises ChatTemplateError.
  """
  text = template.render(messages)
  spans = []
  for i, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    before = template.render(messages[:i], add_generation_prompt=True)
    through = template.render(messages[: i + 1])
    if not (through.startswith(before) and text.startswith(through)):
      raise ChatTemplateError(
        f"the chat template of {template.source} renders assistant turn {i} differently once "
        "later turns follow; split the conversation so that it is the last turn"
      )
    if len(through) > len(before):
      spans.append((len(before), len(through)))
  return text, spans


def tokenize_conversation(
  template: ChatTemplate, hf_tokenizer, messages: Sequence[Message]
) -> tuple[list[int], list[int]]:
  """(ids, loss mask): the rendered conversation encoded with no specials added (the template
  writes them), and 1 on exactly the tokens that start inside an assistant turn."""
  text, spans = assistant_spans(template, messages)
  encoding = hf_tokenizer.encode(text, add_special_tokens=False)
  mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
  return list(encoding.ids), mask
