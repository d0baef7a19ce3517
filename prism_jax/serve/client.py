"""A Python client of a running explorer (httpx), and the loopback load test.

  c = Client("http://127.0.0.1:8000")
  gen = c.generate("The for statement", max_new_tokens=16)   # {"prompt", "tokens", "done"}
  dec = c.decompose(ids=gen["done"]["ids"])

`load_test` fires `requests` generate and decompose calls with at most `concurrency` in
flight (asyncio), and returns every answer with its latency: benchmarks/serve_load.py and
tests/test_serve_api.py check the answers and record the latencies and compile counts.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx


def _lines(text: str) -> dict:
  out = {"prompt": None, "tokens": [], "done": None}
  for line in text.splitlines():
    msg = json.loads(line)
    if "prompt" in msg:
      out["prompt"] = msg
    elif msg.get("done"):
      out["done"] = msg
    else:
      out["tokens"].append(msg)
  return out


class Client:
  def __init__(self, url: str, token: str | None = None, timeout: float = 120.0):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

  def _check(self, r: httpx.Response):
    if r.status_code >= 400:
      raise ValueError(f"{r.status_code}: {r.json().get('error')}")
    return r

  def status(self) -> dict:
    return self._check(self.http.get("/api/status")).json()

  def generate(self, prompt=None, **body) -> dict:
    if prompt is not None:
      body["prompt"] = prompt
    return _lines(self._check(self.http.post("/api/generate", json=body)).text)

  def decompose(self, prompt=None, **body) -> dict:
    if prompt is not None:
      body["prompt"] = prompt
    return self._check(self.http.post("/api/decompose", json=body)).json()


async def _one(http: httpx.AsyncClient, kind: str, body: dict, gate: asyncio.Semaphore):
  async with gate:
    t0 = time.perf_counter()
    r = await http.post(f"/api/{kind}", json=body)
    ms = 1e3 * (time.perf_counter() - t0)
  answer = _lines(r.text) if kind == "generate" and r.status_code == 200 else r.json()
  return {"kind": kind, "body": body, "status": r.status_code, "ms": ms, "answer": answer}


async def _load(url: str, jobs, concurrency: int, token: str | None):
  gate = asyncio.Semaphore(concurrency)
  headers = {"Authorization": f"Bearer {token}"} if token else {}
  limits = httpx.Limits(max_connections=concurrency)
  async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600.0,
                               limits=limits) as http:
    return await asyncio.gather(*(_one(http, k, b, gate) for k, b in jobs))


def load_test(url: str, jobs: list[tuple[str, dict]], *, concurrency: int = 16,
              token: str | None = None) -> list[dict]:
  """Sends jobs [("generate" | "decompose", body), ...] at once, `concurrency` in flight."""
  return asyncio.run(_load(url, jobs, concurrency, token))


def percentiles(ms: list[float]) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top  (deferred: numpy; the load-test client imports httpx alone)
  a = np.asarray(ms)
  return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
          "max_ms": float(a.max()), "n": int(a.size)}
