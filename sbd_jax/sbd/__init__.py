"""The paper's method: SBD masks, noising and the NTP + MATP objective, reveal rules."""
