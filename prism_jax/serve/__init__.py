"""`prism serve`: a live explorer of one PRISM run in the browser (Starlette on uvicorn).

  from prism_jax.serve import server
  server.serve("runs/demo")                      # http://127.0.0.1:8000

prism_jax/serve/engine.py holds the model work (bucketed, compiled once per bucket, one
thread), state.py what is served, requests.py the bounds, app.py the routes, static/ the page.
Needs the `serve` extra (pip install prism_jax[serve]).
"""
