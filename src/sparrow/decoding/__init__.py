"""The loop: a round of draft -> score -> verify -> commit, for one sequence (engine) and a batch, both with the
state changes of `round`; the plain-decoding oracle (baseline)."""
