"""The OpenAI-compatible frontend process (``python -m frontend``): ``api_server.py`` wires
its rooms, laid along a request's way (docs/frontend.md): ``http/`` (the server's edge),
``schema/``, ``text/``, ``tools/``, ``sampling/``, ``engine/`` (the client of the
scheduler), ``openai/`` (the handlers) and ``routes/``. Beside it, for now, the
``kvpool serve`` supervisor (DESIGN.md, Layout).

Imports only `protocol/` of the project, and never torch or transformers."""
