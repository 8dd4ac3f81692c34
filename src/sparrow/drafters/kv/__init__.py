"""Draft-KV policies: what part of the target's KV cache a self-draft attends to."""
