"""kvpool's wire protocol: every message a msgspec Struct in a tagged union.

Two conversations, each its own union:

* client <-> scheduler (`protocol.client_messages`): Generate / Abort in,
  EngineCoreOutputs (a TokenOutput per request, one frame per client per step) /
  RequestError out.
* scheduler <-> worker (`protocol.worker_messages`): WorkerHello, WorkerReady,
  StepPlan, StepResult, WorkerError, Heartbeat, Shutdown.

`protocol.codec.Codec` is built once per socket and turns any bad frame into a
single `ProtocolError`. This package imports neither torch nor scheduler/worker.
"""
