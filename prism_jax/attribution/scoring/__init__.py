"""Scoring training sequences against a query: cached PRISM attribution (influence),
the exact prototype-space score (influence_full), gradient dot-products (grad_dot)."""
