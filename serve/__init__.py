"""`specedge serve`: the runtime behind an OpenAI-compatible HTTP API, one bundle per
server, one generation at a time, requests queued in order. Needs the serve extra
(pip install 'specedge[serve]'); imports no torch."""
