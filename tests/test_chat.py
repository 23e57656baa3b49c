"""Chat templates rendered as transformers renders them, token for token, and converted along
with the model."""

import json

import pytest

transformers = pytest.importorskip("transformers", reason="chat parity needs transformers")
pytest.importorskip("torch", reason="the tiny HF models need torch")

from hf_models import (  # noqa: E402  (tests/ is on sys.path)
  LLAMA3_STYLE_TEMPLATE,
  QWEN3_STYLE_TEMPLATE,
  add_chat_template,
  make_llama,
  make_qwen3,
)

from sbd_jax.data import chat  # noqa: E402
from sbd_jax.data.tokenizer import HFTokenizer  # noqa: E402
from sbd_jax.hf import importer  # noqa: E402

CONVERSATIONS = [
  [{"role": "user", "content": "What is 2 + 3?"}],
  [
    {"role": "system", "content": "  You answer briefly.  "},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "<think>small ones</think>\n\n7"},
    {"role": "user", "content": "Another, with ünïcode: ≥ 10?"},
  ],
  [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! <think>not a think block here"},
  ],
]
FAMILIES = {
  "llama3": (make_llama, LLAMA3_STYLE_TEMPLATE, False),
  "qwen3": (make_qwen3, QWEN3_STYLE_TEMPLATE, True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  """(name, HF model dir with a chat template, converted workdir)."""
  make, template, as_file = FAMILIES[request.param]
  hf_dir = str(tmp_path_factory.mktemp(f"{request.param}_chat_hf"))
  make(hf_dir)
  add_chat_template(hf_dir, template, as_file)
  out = str(tmp_path_factory.mktemp(f"{request.param}_chat_converted"))
  importer.import_hf(hf_dir, out, dtype="float32")
  return request.param, hf_dir, out


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_matches_transformers_token_for_token(family, conversation, generation_prompt):
  name, hf_dir, out = family
  messages = CONVERSATIONS[conversation]
  hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
  expected_text = hf.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=generation_prompt
  )
  expected_ids = hf(expected_text, add_special_tokens=False)["input_ids"]
  template = chat.ChatTemplate.from_tokenizer_dir(out)  # the copy the converter made
  assert template is not None, f"{name}: template not carried into the converted directory"
  text = template.render(messages, add_generation_prompt=generation_prompt)
  assert text == expected_text
  ours = HFTokenizer.from_path(out).tokenizer.encode(text, add_special_tokens=False).ids
  assert ours == expected_ids
  if name == "llama3":
    assert ours[0] == hf.bos_token_id  # the template's BOS, encoded once
  else:
    assert hf.bos_token_id is None or ours[0] != hf.bos_token_id


def test_template_kwargs_and_errors(family):
  name, hf_dir, out = family
  template = chat.ChatTemplate.from_tokenizer_dir(out)
  messages = CONVERSATIONS[0]
  if name == "qwen3":
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    expected = hf.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert template.render(messages, True, enable_thinking=False) == expected
    assert expected.endswith("<think>\n\n</think>\n\n")
  bad = [{"role": "tool", "content": "x"}]
  with pytest.raises(chat.ChatTemplateError, match="role"):
    template.render(bad if name == "qwen3" else [{"role": "system", "content": "s"}, *bad])
  with pytest.raises(chat.ChatTemplateError, match="message 0"):
    template.render(["not a message"])


def test_no_template_and_broken_template(tmp_path):
  assert chat.ChatTemplate.from_tokenizer_dir(str(tmp_path)) is None
  (tmp_path / chat.TEMPLATE_FILE).write_text("{% for m in messages %}{{ m.content }")
  broken = chat.ChatTemplate.from_tokenizer_dir(str(tmp_path))
  with pytest.raises(chat.ChatTemplateError, match="does not parse"):
    broken.render(CONVERSATIONS[0])


# SFT data: the loss covers the assistant turns and nothing else ---------------------------------

MULTI_TURN = [
  {"role": "user", "content": "Name a prime."},
  {"role": "assistant", "content": "7"},
  {"role": "user", "content": "And an even one ≥ 10?"},
  {"role": "assistant", "content": "There is none: 2 is the only even prime."},
]
# The end-of-turn markup each family's template writes after an answer (learned, as a stop).
TURN_END = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>\n"}


def test_loss_mask_covers_exactly_the_assistant_turns(family):
  name, _, out = family
  tokenizer = HFTokenizer.from_path(out)
  template = chat.ChatTemplate.from_tokenizer_dir(out)
  ids, mask = chat.tokenize_conversation(template, tokenizer.tokenizer, MULTI_TURN)
  assert (
    ids == tokenizer.tokenizer.encode(template.render(MULTI_TURN), add_special_tokens=False).ids
  )
  answers = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
  markup = tokenizer.tokenizer.encode(TURN_END[name], add_special_tokens=False).ids
  # One token per UTF-8 byte (no merges in the test tokenizer), plus the turn-end markup.
  assert sum(mask) == sum(len(a.encode()) + len(markup) for a in answers)
  trained = tokenizer.tokenizer.decode(
    [i for i, m in zip(ids, mask) if m], skip_special_tokens=False
  )
  assert trained == "".join(a + TURN_END[name] for a in answers)


def test_chat_records_through_the_training_pipeline(family, tmp_path):
  from sbd_jax.data import pipeline, sources

  name, _, out = family
  tokenizer = HFTokenizer.from_path(out)
  template = chat.ChatTemplate.from_tokenizer_dir(out)
  row = pipeline.encode_record(
    {"messages": MULTI_TURN}, tokenizer, prompt_loss=False, eos_tail=2, chat_template=template
  )
  ids, mask = chat.tokenize_conversation(template, tokenizer.tokenizer, MULTI_TURN)
  ends_in_eos = ids[-1] == tokenizer.eos_id
  extra = [] if ends_in_eos else [tokenizer.eos_id]
  assert row["tokens"].tolist() == ids + extra + [tokenizer.eos_id] * 2
  assert row["loss_mask"].tolist() == mask + [1] * len(extra) + [0, 0]
  if name == "llama3":
    assert row["tokens"][0] == tokenizer.bos_id and (row["tokens"] == tokenizer.bos_id).sum() == 1
  else:
    assert tokenizer.tokenizer.id_to_token(int(row["tokens"][0])) == "<|im_start|>"  # no BOS
  path = tmp_path / "chats.jsonl"
  path.write_text("\n".join(json.dumps({"messages": MULTI_TURN}) for _ in range(3)) + "\n")
  cfg = pipeline.default_data_config()
  cfg.source, cfg.paths, cfg.shuffle = "jsonl", str(path), False
  batch = next(
    pipeline.make_train_iterator(cfg, tokenizer, batch_size=3, seq_len=len(row["tokens"]), seed=0)
  )
  assert batch["loss_mask"].sum(axis=1).tolist() == [row["loss_mask"].sum()] * 3
  with pytest.raises(sources.DataError, match="needs a chat template"):
    pipeline.encode_record({"messages": MULTI_TURN}, tokenizer, prompt_loss=False)


def test_template_that_rewrites_earlier_turns_is_refused(family):
  name, _, out = family
  template = chat.ChatTemplate.from_tokenizer_dir(out)
  thinking = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "<think>small ones</think>\n\n7"},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "11"},
  ]
  if name == "qwen3":  # drops the first answer's reasoning once a later question exists
    with pytest.raises(chat.ChatTemplateError, match="assistant turn 1"):
      chat.assistant_spans(template, thinking)
    _, spans = chat.assistant_spans(template, thinking[2:])  # the last turn alone is fine
    assert len(spans) == 1
  else:
    assert len(chat.assistant_spans(template, thinking)[1]) == 2


def test_bad_chat_records_are_named():
  from sbd_jax.data import sources

  for bad, match in (
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] has no string 'content'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
  ):
    with pytest.raises(sources.DataError, match=match):
      sources.parse_record(bad, "text", "chats.jsonl:3")


@pytest.mark.integration  # a fine-tune and an export
@pytest.mark.parametrize("family", ["llama3"], indirect=True)  # one family: training is slow
def test_finetune_on_chats_and_export_keeps_the_template(family, tmp_path):
  """SBD fine-tuning of the converted model on {"messages": ...} JSONL (both losses on the
  assistant turns), then export: the exported tokenizer renders the same chats."""
  import importlib.util
  import os

  import numpy as np

  from sbd_jax.hf import exporter
  from sbd_jax.training import trainer

  name, _, out = family
  data = tmp_path / "chats.jsonl"
  with open(data, "w") as f:
    for i in range(32):
      turns = [
        {"role": "user", "content": f"{i}+{i}?"},
        {"role": "assistant", "content": str(2 * i)},
      ]
      f.write(json.dumps({"messages": turns}) + "\n")
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_hf.py")
  spec = importlib.util.spec_from_file_location("configs_tiny_hf_chat", path)
  tiny_hf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tiny_hf)
  c = tiny_hf.get_config(out)
  c.data.paths = str(data)
  c.train.steps, c.train.batch_size, c.train.seq_len, c.train.log_every = 2, 8, 128, 1
  c.checkpoint.every_steps, c.checkpoint.async_save = 2, False
  c.train.progress_bar, c.optim.warmup_steps = False, 1
  run = tmp_path / "run"
  metrics = trainer.train(c, str(run))
  assert np.isfinite(metrics["loss"]) and metrics["matp_loss"] > 0
  exported = tmp_path / "hf"
  exporter.export_hf(str(run), str(exported))
  again = chat.ChatTemplate.from_tokenizer_dir(str(exported))
  original = chat.ChatTemplate.from_tokenizer_dir(out)
  assert again.render(MULTI_TURN, True) == original.render(MULTI_TURN, True)
