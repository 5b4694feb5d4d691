"""Token sampling: greedy, top-k/p/min-p, penalties, seeded noise."""
