"""A JSONL task whose answers are JSON objects the prompt determines: a person's name, age, city
and job extracted from a sentence, for the structured-output benchmark (`benchmarks.structured`).

    {"prompt": "Extract: Ana Silva, 34, lives in Lyon and works as a baker.\\nJSON:",
     "completion": "{\\"name\\":\\"Ana Silva\\",\\"age\\":34,\\"city\\":\\"Lyon\\",\\"job\\":\\"baker\\"}"}

The answer is compact JSON in the schema's key order (`SCHEMA`), as a constrained decode writes
it (`constrain.regexes`). Also a byte-level BPE of 128k tokens made offline (`synthetic_bpe`),
to size the automaton tables of a Llama-3-sized vocabulary.
"""

from __future__ import annotations

import json
import random

import numpy as np

# Every value bounded in bytes (a first and last name, a one-word city and job; an age of at
# most 3 digits), so that every answer the schema allows is at most LONGEST bytes: a constrained
# decode with room for that and its EOS always ends complete, whatever the model. (Bounded
# repeats of a wide character class compile slowly in outlines-core: `[A-Za-z ]{0,23}` takes
# minutes, past the compiler's bound; these take milliseconds.)
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7} [A-Z][a-z]{1,9}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "job": {"type": "string", "pattern": "^[a-z]{2,12}$"},
  },
  "required": ["name", "age", "city", "job"],
  "additionalProperties": False,
}
LONGEST = len('{"name":"","age":150,"city":"","job":""}') + 19 + 8 + 12  # 79 bytes
FIRST = ["Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kofi", "Lea",
         "Mara", "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tove", "Uma", "Vik", "Wen", "Yusuf"]  # fmt: skip
LAST = ["Silva", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Haddad", "Kowalski",
        "Reyes", "Fischer", "Osei", "Larsen", "Duarte", "Ivanova", "Park", "Bauer"]  # fmt: skip
CITIES = ["Lyon", "Accra", "Osaka", "Porto", "Tartu", "Quito", "Leeds", "Brno", "Cusco", "Oslo",
          "Hue", "Basel", "Izmir", "Perth", "Cork", "Kazan"]  # fmt: skip
JOBS = ["baker", "nurse", "pilot", "welder", "teacher", "chemist", "tailor", "farmer", "judge",
        "plumber", "editor", "dentist", "gardener", "potter", "surveyor", "violinist"]  # fmt: skip
TEMPLATES = [
  "{name}, {age}, lives in {city} and works as a {job}.",
  "{name} is a {age}-year-old {job} from {city}.",
  "Meet {name} ({age}), a {job} in {city}.",
  "In {city}, {name} works as a {job}; {name_first} is {age}.",
]


def records(n: int, seed: int) -> list[dict[str, str]]:
  """`n` {"prompt", "completion"} records drawn with `seed`."""
  rng = random.Random(f"structured/{seed}")
  out = []
  for _ in range(n):
    first, last = rng.choice(FIRST), rng.choice(LAST)
    person = {
      "name": f"{first} {last}",
      "age": rng.randint(18, 90),
      "city": rng.choice(CITIES),
      "job": rng.choice(JOBS),
    }
    sentence = rng.choice(TEMPLATES).format(**person, name_first=first)
    answer = json.dumps(person, separators=(",", ":"))
    out.append({"prompt": f"Extract: {sentence}\nJSON:", "completion": answer})
  return out


def synthetic_bpe(num_tokens: int = 128_000, seed: int = 0):
  """A byte-level BPE (`HFTokenizer`) of `num_tokens` regular tokens plus Llama-3's 256 reserved
  specials (128,256 ids at the default): each token extends an earlier one by a byte, drawn
  with text-like weights (letters, spaces, digits, JSON punctuation), and is the merge of the
  two."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  from sbd_jax.constrain.vocabulary import byte_level_table
  from sbd_jax.data.tokenizer import HFTokenizer

  rng = np.random.default_rng(seed)
  char_of = {b: c for c, b in byte_level_table().items()}
  weights = np.ones(256)
  weights[list(b"abcdefghijklmnopqrstuvwxyz")] = 40
  weights[list(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")] = 8
  weights[list(b' ",{}[]:.-_\\')] = [60, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]
  chars = [char_of[b] for b in range(256)]
  tokens, merges = list(chars), []
  seen = set(tokens)
  draws = iter(rng.choice(256, size=8 * num_tokens, p=weights / weights.sum()))
  bases = iter(rng.random(8 * num_tokens))
  while len(tokens) < num_tokens:
    base = tokens[int(next(bases) * len(tokens))]
    new = base + chars[next(draws)]
    if len(base) <= 12 and new not in seen:
      seen.add(new)
      tokens.append(new)
      merges.append((base, new[-1]))
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
    f"<|reserved_special_token_{i}|>" for i in range(254)
  ]
  tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
  ids = tok.get_vocab()
  return HFTokenizer(
    tok,
    bos_id=ids[specials[0]],
    eos_id=ids[specials[1]],
    pad_id=ids[specials[1]],
    mask_id=ids[specials[2]],
  )
