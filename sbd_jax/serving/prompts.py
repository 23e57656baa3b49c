"""A request's prompts as token ids: text prompts encoded as `sample` encodes them, a chat
rendered by the tokenizer's template, token-id prompts checked against the vocabulary, each
bounded by the server's `--max_prompt_tokens`. Text is first bounded in characters: longer than
`max_prompt_tokens` tokens can spell (`char_limit`), it is refused before the tokenizer sees it,
so that no request costs more tokenizing than the longest prompt that fits. A chat is bounded
twice: its contents before the template renders them, the rendered text (which adds text per
message) before it is encoded.

Text the tokenizer cannot take (not valid Unicode: a lone surrogate such as JSON's "\\ud800";
anything the tokenizer raises on; a conversation the template refuses) is the client's error: a
one-line `BadRequest` (400), never a server error. These functions run off the event loop.
"""

from __future__ import annotations

from sbd_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from sbd_jax.serving.protocol import BadRequest, Limits, too_many_tokens


def char_limit(tokenizer, max_prompt_tokens: int) -> int | None:
  """The most characters `max_prompt_tokens` tokens can spell: a byte tokenizer's token is one
  UTF-8 byte (at most a character); a Hugging Face vocabulary's, at most its longest entry. None
  (no bound) for a vocabulary whose unknown token stands for any word, or another tokenizer."""
  if isinstance(tokenizer, ByteTokenizer):
    return max_prompt_tokens
  if not isinstance(tokenizer, HFTokenizer):
    return None
  model = tokenizer.tokenizer.model
  if getattr(model, "unk_token", None) and not getattr(model, "byte_fallback", False):
    return None
  vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
  return max_prompt_tokens * max(len(token) for token in vocab)


def token_lists(prompt, tokenizer, limits: Limits) -> list[list[int]]:
  """A completion request's prompts as token ids (text as `sample` encodes it)."""
  if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
    prompt = [prompt]
  if not prompt:
    raise BadRequest("prompt is empty")
  out = []
  for p in prompt:
    if isinstance(p, str):
      _check_chars(len(p), limits)
      out.append(_encode(tokenizer.encode_document, p, "prompt"))
    else:
      out.append(list(p))
  for ids in out:
    check(ids, limits)
  return out


def chat_ids(template, tokenizer, messages: list[dict], limits: Limits) -> list[int]:
  """A conversation rendered by the chat template (its special tokens in the text) and
  encoded with no specials added, as `evaluate` prompts a chat model."""
  for i, message in enumerate(messages):
    _check_text(message["content"], f"messages[{i}].content")
  _check_chars(sum(len(m["content"]) for m in messages), limits)
  try:
    text = template.render(messages, add_generation_prompt=True)
  except Exception as e:  # e.g. data.chat.ChatTemplateError: it refused the conversation
    raise BadRequest(" ".join(str(e).split())[:300] or type(e).__name__) from None
  _check_chars(len(text), limits, "the rendered chat")
  ids = _encode(tokenizer.encode, text, "messages")
  check(ids, limits)
  return ids


def check(ids: list[int], limits: Limits) -> None:
  if not ids:
    raise BadRequest("prompt is empty")
  if len(ids) > limits.max_prompt_tokens:
    raise BadRequest(too_many_tokens(len(ids), limits.max_prompt_tokens))
  if min(ids) < 0 or max(ids) >= limits.vocab_size:
    raise BadRequest(f"prompt has token ids outside [0, {limits.vocab_size})")


def _check_chars(chars: int, limits: Limits, what: str = "prompt") -> None:
  if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
    raise BadRequest(
      f"{what} has {chars} characters, more than --max_prompt_tokens={limits.max_prompt_tokens} "
      f"tokens spell (at most {limits.max_prompt_chars})"
    )


def _check_text(text: str, field: str) -> None:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    message = f"{field}: not valid Unicode (a lone surrogate at character {e.start})"
    raise BadRequest(message) from None


def _encode(encode, text: str, field: str) -> list[int]:
  _check_text(text, field)
  try:
    return list(encode(text))
  except Exception as e:  # whatever the tokenizer cannot take is the client's text
    raise BadRequest(f"{field}: the tokenizer cannot encode it ({type(e).__name__})") from None
