"""`photon proxy`: the HTTP front of prefill/decode disaggregation (see docs/disaggregation.md)."""
