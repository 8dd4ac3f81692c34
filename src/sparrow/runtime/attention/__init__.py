"""Attention implementations: query capture, packed decode attention, row-wise attention."""
