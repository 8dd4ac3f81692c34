"""The loop: a round of draft -> score -> verify -> commit, for one sequence (engine) and a batch; the
plain-decoding oracle (baseline)."""
