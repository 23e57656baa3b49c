"""Structured output: constraints compiled to token automata, and their tables on device.

spec        `Constraint`: a regex, a JSON schema, any JSON object, or a choice of strings
schema      the JSON-schema subset outlines-core enforces exactly, checked and inlined
regexes     a constraint as one regex (outlines-core turns schemas into regexes)
index       outlines-core's token index of a regex, complete (an end marker; see the module)
vocabulary  `TokenVocabulary`: the bytes each token id decodes to, from a project tokenizer
automaton   `TokenAutomaton`: outlines-core's token index as packed bitmasks and moves
tables      several automata packed into one `ConstraintTables` set for a batch
device      jit-friendly primitives: mask logits, advance states, final and forced tokens
compiler    `ConstraintCompiler`: compiles in a worker process, bounded in time, states and
            bytes, with an LRU cache keyed by (constraint, vocabulary fingerprint)
worker      the worker process's loop
"""
