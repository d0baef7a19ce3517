"""The live explorer of a trained run in the browser (prism_jax/serve).

  prism serve --workdir=runs/demo [--port=8000] [--host=127.0.0.1] [--token=...]
      [--allow_host=name,...] [--nobuild_cache] [--nobuild_cards]

Binds 127.0.0.1 unless --host says otherwise; another host needs an access token (given with
--token, or generated and printed), required on every request (the page's own assets get it
from a cookie). Requests are answered only under the bound address's names (on loopback:
localhost, 127.0.0.1, ::1) and --allow_host's, and only from the explorer's own page: another
origin's Origin header is refused. Cards are built under <workdir>/cards at start when
missing; the attribution cache on first use (--nobuild_cache: refused instead). Needs the
`serve` extra (pip install 'prism_jax[serve]').
"""

from absl import flags

# The serve extra is checked and prism_jax.serve imported inside main(): a bad flag or --help is
# answered without them.

flags.DEFINE_string("workdir", None, "trained PRISM run directory (prism train)")
flags.DEFINE_string("host", "127.0.0.1", "address to bind (not loopback: a token is required)")
flags.DEFINE_integer("port", 8000, "port to bind")
flags.DEFINE_string("token", None, "access token (default on a non-loopback host: a fresh one)")
flags.DEFINE_list("allow_host", [], "more Host names to answer to, e.g. a DNS name or a reverse "
                  "proxy's (no port); default: the bound address's names, any name on a "
                  "wildcard --host with a token")
flags.DEFINE_bool("build_cache", True, "build the attribution cache on first use")
flags.DEFINE_bool("build_cards", True, "build the prototype cards at start when missing")
flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if not 1 <= FLAGS.port <= 65535:
    raise ValueError(f"--port must be in [1, 65535], got {FLAGS.port}")
  try:
    import starlette, uvicorn  # pylint: disable=g-import-not-at-top,multiple-imports,unused-import  # noqa: F401
  except ImportError:
    raise ModuleNotFoundError("prism serve needs the serve extra: pip install "
                              "'prism_jax[serve]'") from None
  from prism_jax.serve import server  # pylint: disable=g-import-not-at-top
  server.serve(FLAGS.workdir, host=FLAGS.host, port=FLAGS.port, token=FLAGS.token,
               build_cache=FLAGS.build_cache, build_cards=FLAGS.build_cards, step=FLAGS.step,
               allow_hosts=FLAGS.allow_host)
