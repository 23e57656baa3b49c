"""Decoding: NTP and SBD with an exact KV cache, in one on-device loop.

settings   `SamplerSettings`, the one declaration of the decode's options and defaults
state, sampling, reveal, loop   the loop's carry, token choice, the reveal, the forwards
verify, acceptance   verified SBD's check against NTP, and its drafts counted as vLLM counts
policy, costs   which forward a verified decode runs next, and what its forwards cost here
compiled   the loop compiled (weights as an argument, one packed result, compile count)
queue      continuous batching: a queue of prompts through the rows, finished rows refilled
memory     what a decode needs in a device's memory, checked before it allocates
sampler    host side: prompts in, tokens and texts out
"""
