"""OpenAI-compatible request bodies, and what a request asks the engine for.

The standard fields are OpenAI's (`response_format` on completions too), with vLLM's
`structured_outputs` (both read by `serving.structured`). SBD adds five, all optional:
`decoding` ("sbd" or "ntp"), `gamma`, `rule`, `block_size` and `verify` (SBD checked against
NTP: NTP's text); unset, they and `temperature` are the run's `sample` settings.
`n` > 1 decodes each prompt n times, as rows of the request: choice i x n + j is prompt i's
draw j (its key folds in the choice index), as OpenAI orders them.
Unknown fields, and values the server cannot honour (echo, top logprobs, penalties, top_p
below 1, a logit bias, a suffix, best_of above 1, content parts other than text, a constraint
`serving.structured` does not take), are refused with a one-line message rather than ignored;
such fields at their default values are accepted, and so is `null` wherever OpenAI's spec
allows it (it means the default; an assistant message's content may be null). Fields OpenAI
accepts only together are refused apart: `top_logprobs` without `logprobs`, `stream_options`
without `stream`.

`temperature` is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]: below, logits over the
temperature overflow float32. A `seed` is any int64, as OpenAI and vLLM take it (`key_seed` maps
it to the decode's 32-bit key). A sampled request without a `seed` draws a fresh one, which the
response reports (`seed`), so that the same request sent twice gives two samples and either can
be replayed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Literal

import pydantic

from sbd_jax.constrain.automaton import TokenAutomaton
from sbd_jax.constrain.spec import Constraint
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.sbd import reveal_rules

NOT_SCORED = (
  "loglikelihood scoring (echo) is not served: SBD changes generation only; score such tasks "
  "on the exported HF model (python -m sbd_jax.convert) in transformers"
)
NO_ALTERNATIVES = (
  "only the chosen tokens' log-probabilities are served (completions: logprobs=0; chat: "
  "logprobs=true without top_logprobs)"
)


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 2.0
MAX_STOPS, MAX_STOP_CHARS = 8, 256
MAX_N = 16  # choices per prompt (rows of one request)
MAX_STOP_TOKEN_IDS = 16
STOPS_BOUND = f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each"
# Fields OpenAI's spec lets a client send as null: null is the field's default.
NULLABLE = ("n", "stream", "frequency_penalty", "presence_penalty", "echo", "logprobs")


class BadRequest(ValueError):
  """A request the server refuses with HTTP 400 and this one-line message (`param`: the
  request field it names, for OpenAI's error body)."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


class ModelNotFound(LookupError):
  """A request naming a model the server does not serve: 404 `model_not_found`, as OpenAI's."""


def too_many_tokens(tokens: int, max_prompt_tokens: int) -> str:
  return (
    f"prompt has {tokens} tokens, more than the server's --max_prompt_tokens={max_prompt_tokens}"
  )


def check_choices(choices: int, max_queue: int) -> None:
  """A request of more choices (prompts x n) than the queue holds could never run."""
  if choices > max_queue:
    raise BadRequest(
      f"{choices} choices (prompts x n): more than the server queues at once "
      f"(--max_queue={max_queue})"
    )


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")

  model: str | None = None
  max_tokens: int | None = pydantic.Field(None, ge=1)
  temperature: float | None = pydantic.Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
  top_p: float | None = None
  n: int = pydantic.Field(1, ge=1, le=MAX_N)
  stream: bool = False
  stream_options: dict | None = None
  stop: str | list[str] | None = None
  # Token ids that end a choice as EOS does (not sent): e.g. a chat model's end-of-turn ids.
  stop_token_ids: list[int] | None = pydantic.Field(None, max_length=MAX_STOP_TOKEN_IDS)
  seed: int | None = pydantic.Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
  user: str | None = None
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  # SBD's own: unset means the run's `sample` settings.
  decoding: Literal["sbd", "ntp"] | None = None
  gamma: float | None = pydantic.Field(None, ge=0, allow_inf_nan=False)
  rule: str | None = None
  block_size: int | None = pydantic.Field(None, ge=1)
  verify: bool | None = None
  # Structured output (`serving.structured`): OpenAI's and vLLM's, read there.
  response_format: dict | None = None
  structured_outputs: dict | None = None

  @pydantic.field_validator(*NULLABLE, mode="before", check_fields=False)
  @classmethod
  def _null_is_the_default(cls, value, info):
    return cls.model_fields[info.field_name].default if value is None else value

  def check_supported(self) -> None:
    if self.stream_options and not self.stream:
      raise BadRequest("stream_options is only allowed with stream=true")
    if self.top_p not in (None, 1, 1.0):
      raise BadRequest(f"top_p={self.top_p} is not supported (only 1)")
    if self.frequency_penalty or self.presence_penalty:
      raise BadRequest("frequency_penalty and presence_penalty are not supported (only 0)")
    if self.logit_bias:
      raise BadRequest("logit_bias is not supported (only {})")
    if self.temperature and self.temperature < MIN_TEMPERATURE:
      raise BadRequest(
        f"temperature={self.temperature:g}: use 0 (greedy) or at least {MIN_TEMPERATURE:g}"
      )
    stops = self.stops()
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
      raise BadRequest(STOPS_BOUND)

  def stops(self) -> list[str]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    return [s for s in stops if s]

  def include_usage(self) -> bool:
    return bool((self.stream_options or {}).get("include_usage"))

  def wants_logprobs(self) -> bool:
    return False


class CompletionRequest(_Body):
  prompt: str | list[str] | list[int] | list[list[int]]
  echo: bool = False
  logprobs: int | None = None
  suffix: str | None = None
  best_of: int | None = None

  def check_supported(self) -> None:
    super().check_supported()
    if self.echo:
      raise BadRequest(NOT_SCORED)
    if self.logprobs:
      raise BadRequest(f"logprobs={self.logprobs}: {NO_ALTERNATIVES}")
    if self.suffix:
      raise BadRequest("suffix is not supported (text is only appended to the prompt)")
    if self.best_of not in (None, 1):
      raise BadRequest(f"best_of={self.best_of} is not supported (only 1: choices are not ranked)")
    if self.best_of == 1 and self.n > 1:
      raise BadRequest(f"best_of=1 is less than n={self.n}")

  def wants_logprobs(self) -> bool:
    return self.logprobs is not None


class ContentPart(pydantic.BaseModel):
  """A part of a message's content: only text is served (`ChatMessage.check`)."""

  model_config = pydantic.ConfigDict(extra="allow")

  type: str
  text: str | None = None


IMAGE_PARTS = ("image_url", "input_image", "image")


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")

  role: Literal["system", "user", "assistant", "developer"]
  content: str | list[ContentPart] | None  # null: an assistant's (OpenAI's, with tool calls)
  name: str | None = None

  def check(self, field: str) -> None:
    """BadRequest for content the server cannot read: null outside an assistant message, a
    part other than text."""
    if self.content is None and self.role != "assistant":
      raise BadRequest(f"{field}.content: null only in an assistant message")
    for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
      where = f"{field}.content[{j}]"
      if part.type in IMAGE_PARTS:
        raise BadRequest(f"{where}: images are not supported (this model reads text)")
      if part.type != "text":
        raise BadRequest(f"{where}: content parts of type {part.type!r} are not supported")
      if part.text is None:
        raise BadRequest(f"{where}: a text part needs its text")

  def rendered(self) -> dict:
    """The message as the chat template takes it: content as one string (text parts joined,
    null as empty)."""
    content = self.content or ""
    if not isinstance(content, str):
      content = "".join(part.text for part in content)
    return {**self.model_dump(exclude_none=True), "content": content}


class ChatRequest(_Body):
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = None

  def check_supported(self) -> None:
    super().check_supported()
    for i, message in enumerate(self.messages):
      message.check(f"messages[{i}]")
    if self.top_logprobs is not None and not self.logprobs:
      raise BadRequest("top_logprobs is only allowed with logprobs=true")
    if self.top_logprobs:
      raise BadRequest(f"top_logprobs={self.top_logprobs}: {NO_ALTERNATIVES}")

  def wants_logprobs(self) -> bool:
    return self.logprobs


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server was started with, and what the model was trained for."""

  max_prompt_tokens: int
  max_new_tokens: int
  largest_block: int  # the largest SBD block the run trained (sbd.k_max)
  vocab_size: int
  # Text prompts longer than this are refused before they are tokenized: what max_prompt_tokens
  # tokens can spell. Unset, `app.create_app` derives it from the tokenizer (`prompts.char_limit`).
  max_prompt_chars: int | None = None
  # Every pool compiled constrained (`SamplerSettings.constraint`): requests may ask for a
  # constraint (`serving.structured`).
  structured_output: bool = False


@dataclasses.dataclass(frozen=True)
class Decoding:
  """A request's decode: the engine's compiled settings and the row's own values."""

  settings: SamplerSettings
  gamma: float
  max_tokens: int
  seed: int
  temperature: float
  verify: bool  # SBD rows: drafts checked against NTP (NTP's text)
  # What the text must be (`serving.structured`), and its compiled automaton
  constraint: Constraint | None = None
  automaton: TokenAutomaton | None = None


def decoding(body: _Body, run: SamplerSettings, default_mode: str, limits: Limits) -> Decoding:
  """The decode `body` asks for, over the run's settings `run`; BadRequest if it cannot run."""
  body.check_supported()
  mode = body.decoding or default_mode
  rule = body.rule or run.rule
  if rule not in reveal_rules.RULES:
    raise BadRequest(f"unknown rule {rule!r}; known: {sorted(reveal_rules.RULES)}")
  block = body.block_size or run.block_size
  if mode == "sbd" and block > limits.largest_block:
    raise BadRequest(
      f"block_size {block} exceeds the largest block the model was trained on "
      f"({limits.largest_block})"
    )
  bad_ids = [i for i in body.stop_token_ids or () if not 0 <= i < limits.vocab_size]
  if bad_ids:
    raise BadRequest(f"stop_token_ids {bad_ids} are outside [0, {limits.vocab_size})")
  max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
  max_tokens = max_tokens or limits.max_new_tokens
  if max_tokens > limits.max_new_tokens:
    raise BadRequest(
      f"max_tokens {max_tokens} exceeds the server's --max_new_tokens={limits.max_new_tokens}"
    )
  temperature = run.temperature if body.temperature is None else body.temperature
  verify = mode == "sbd" and bool(run.verify if body.verify is None else body.verify)
  settings = pool_settings(run, limits, mode, block, rule)
  gamma = run.gamma if body.gamma is None else body.gamma
  try:
    reveal_rules.check_gamma(rule, gamma)
  except ValueError as e:
    raise BadRequest(str(e)) from None
  seed = request_seed(body.seed, temperature)
  return Decoding(settings, float(gamma), int(max_tokens), seed, float(temperature), verify)


def pool_settings(
  run: SamplerSettings, limits: Limits, mode: str, block_size: int, rule: str
) -> SamplerSettings:
  """The compiled settings of a server's pool: what a request's mode, block size and rule
  select. γ, the temperature and verification are the rows' own (traced): an SBD pool can
  verify, and each row does or not (`DecodeState.verify_B`). With structured output every pool
  is constrained, and each row has its own constraint, or none (`DecodeState.cstate_B`)."""
  return run.replace(
    mode=mode,
    # NTP ignores the block and the rule: one compiled NTP decode serves every request.
    block_size=block_size if mode == "sbd" else run.block_size,
    rule=rule if mode == "sbd" else run.rule,
    verify=mode == "sbd",
    temperature=settings_lib.TRACED_TEMPERATURE,  # per row, greedy rows too
    gamma=reveal_rules.TRACED_GAMMA,  # per row
    max_new_tokens=limits.max_new_tokens,
    lockstep=False,
    refill=True,
    refill_rows=1,
    logprobs=True,  # a request may ask for them
    constraint=settings_lib.TRACED_CONSTRAINT if limits.structured_output else None,
  )


def allowed_pools(
  run: SamplerSettings, limits: Limits, block_sizes, rules
) -> list[SamplerSettings]:
  """Every pool a server makes and serves: NTP, the run's own SBD setting, and SBD for each
  (block size, rule) of the lists (an empty list: the run's). A one-line ValueError for a block
  the model was not trained on or an unknown rule."""
  block_sizes = list(block_sizes) or [run.block_size]
  rules = list(rules) or [run.rule]
  for block in block_sizes:
    if not 1 <= block <= limits.largest_block:
      raise ValueError(
        f"--block_sizes: {block} is outside the blocks the model was trained on "
        f"(1..{limits.largest_block})"
      )
  for rule in rules:
    if rule not in reveal_rules.RULES:
      raise ValueError(f"--rules: unknown rule {rule!r}; known: {sorted(reveal_rules.RULES)}")
  sbd = [(run.block_size, run.rule), *((b, rule) for b in block_sizes for rule in rules)]
  pools = [pool_settings(run, limits, "ntp", run.block_size, run.rule)]
  pools += [pool_settings(run, limits, "sbd", b, rule) for b, rule in dict.fromkeys(sbd)]
  return pools


def describe(settings: SamplerSettings) -> str:
  """A pool's settings as a request names them."""
  if settings.mode == "ntp":
    return "ntp"
  return f"sbd block_size={settings.block_size} rule={settings.rule}"


def request_seed(seed: int | None, temperature: float) -> int:
  """The request's seed; unset and sampled, a fresh one (greedy decoding ignores it: 0)."""
  if seed is not None:
    return int(seed)
  return secrets.randbits(32) if temperature > 0 else 0


def key_seed(seed: int) -> int:
  """The decode's 32-bit key seed for a request's int64 `seed`: a seed in [0, 2^32) is its own
  (as `sample --seed` draws it); any other is hashed (BLAKE2b of its 8 bytes) to 32 bits."""
  if 0 <= seed < 2**32:
    return seed
  digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=4).digest()
  return int.from_bytes(digest, "little")
