import os

# Multi-device tests run on 8 simulated CPU devices; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
