"""How much to draft: the length, tree and batch policies, their estimates, and the cost measurements they use."""
