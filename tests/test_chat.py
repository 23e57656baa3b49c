"""Chat templates rendered as transformers renders them, token for token, and converted along
with the model."""

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

from sbd_jax import chat  # noqa: E402
from sbd_jax.hf import importer  # noqa: E402
from sbd_jax.tokenizer import HFTokenizer  # noqa: E402

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
