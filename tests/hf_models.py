"""Tiny random Llama-3 / Qwen-3 models and byte-level tokenizers saved as HF directories (shared
by the HF parity, chat and task tests; everything is built offline from configs)."""

import json
import os

import tokenizers
import torch
import transformers

MODEL_VOCAB = 300  # > tokenizer vocabulary: rows past it are unused (as in Qwen-3)
ORIGINAL_CONTEXT = 32  # llama3 rope scaling's original context; prompts go past it
LLAMA_SPECIALS = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
  "<|finetune_right_pad_id|>",
  "<|eot_id|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder, specials, special_config, bos_post_processor=False):
  """Byte-level BPE with no merges (one token per byte) plus added special tokens; with
  `bos_post_processor`, encoding with specials prepends the BOS, as Llama-3's tokenizer does."""
  from tokenizers import decoders, models, pre_tokenizers, processors

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(specials)
  if bos_post_processor:
    bos = special_config["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special_config}, f)


def make_llama(folder):
  """GQA, llama3 RoPE scaling with a 32-token original context, untied embeddings."""
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_scaling={
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": ORIGINAL_CONTEXT,
    },
    bos_token_id=256,
    eos_token_id=257,
  )
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(folder)
  write_tokenizer(
    folder,
    LLAMA_SPECIALS,
    {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    bos_post_processor=True,
  )
  return model


def make_qwen3(folder):
  """QK-norm, head_dim (24) != hidden / heads (16), tied embeddings, no BOS token."""
  torch.manual_seed(1)
  cfg = transformers.Qwen3Config(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    eos_token_id=258,
    pad_token_id=256,
  )
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  model.save_pretrained(folder)
  write_tokenizer(
    folder,
    QWEN_SPECIALS,
    {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
  )
  return model


MAKERS = {"llama": make_llama, "qwen3": make_qwen3}


# Chat templates in the style of the two model families (written for these tests): Llama-3's
# header/eot turns with a default system turn and BOS; Qwen-3's im_start/im_end turns, with
# reasoning stripped from earlier assistant turns and an optional empty think block.
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Cutting Knowledge Date: December 2023" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles follow the system turn') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN3_STYLE_TEMPLATE = """{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content and loop.index0 < ns.last_user %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role | tojson) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def add_chat_template(folder, template, as_file):
  """Saves `template` the way transformers does: a chat_template.jinja file, or the older
  "chat_template" field of tokenizer_config.json."""
  if as_file:
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
      f.write(template)
    return
  path = os.path.join(folder, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  with open(path, "w") as f:
    json.dump({**config, "chat_template": template}, f)
