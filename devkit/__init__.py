"""The development kit shared by the tests (`tests/`) and the benchmarks (`bench/`).

Not part of the product: it is not shipped with the `memstrata` package (only `gateway` and
`memory` are) and nothing under `gateway/` or `memory/` imports it. It holds what both test and
measure with:

* `devkit.service` -- `Service`: a subprocess started, waited for (an HTTP probe), stopped
  (terminate, then kill) with its output kept; `free_port()` and `child_env()`;
* `devkit.gateway` -- `GatewayProcess` (`memstrata serve`) and `WorkerProcess`
  (`memstrata worker`), both `Service`s;
* `devkit.upstream` -- `UpstreamServer`, the fake OpenAI upstream as a `Service` plus a client
  for its control plane; the server itself is `devkit.upstream_server` (its behaviours and
  helpers in `devkit.upstream_script`);
* `devkit.postgres` -- `ThrowawayPostgres`: an embedded Postgres on a temporary folder;
* `devkit.synthetic` -- deterministic multi-topic conversations;
* `devkit.stats` -- `percentile()`.
"""
