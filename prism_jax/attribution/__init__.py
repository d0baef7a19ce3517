"""prism_jax.attribution: training-data attribution, in four rooms.

  caching/    the attribution cache: build (curvature + records passes), format, shards,
              the per-prototype index, opening it for queries
  hessians/   curvature w.r.t. the bank (Gauss-Newton statistics, exact Hessian blocks)
              and EK-FAC over every parameter
  scoring/    scoring training sequences against a query: cached PRISM (influence), the
              exact prototype-space score (influence_full), gradient dot-products
  quality/    attribution quality: the methods behind one registry (methods.py), retrains
              on subsets of the rows (retrain.py), the LDS and removal sets (lds.py)
"""
