"""The serving layer: what turns a parsed request into an engine submission and an answer,
shared by every API that runs inference (chat, completions, batches).

- `ticket`: admission before expensive work (the limiter's two steps, the 429s);
- `prepare`: a request's model, tier, token limits and sampling parameters;
- `chat`, `completion`: a parsed request -> a `Job` (prompts, parameters, how to build its
  choices and its stream);
- `job`: `Job`, a parsed request ready to run, and its `RunInputs`;
- `run`: `RequestRun`, one admitted request's life in the engine (submit, outputs, the usage
  row and the lease settled exactly once);
- `tiers`: the API's service tiers and the engine's refusals as HTTP errors;
- `respond`: a job run to its JSON body or its SSE stream, a client's disconnect included.

Route handlers call these; these call the engine's face (`lockgate.engine`) and tenancy.
"""
