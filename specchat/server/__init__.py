"""`specchat serve`: the engine behind an OpenAI-compatible HTTP endpoint (docs/serve.md).

protocol.py turns request bodies into the engine's settings, responses.py its results into OpenAI's JSON; app.py
holds the routes and hands each request's events from the engine's thread to its handler; admission.py bounds the
requests waiting for the engine; cors.py lets the pages of chosen origins call the server from a browser; metrics.py
writes /metrics; stopping.py ends the answers in flight when the server stops.
"""

STREAM_INTERVAL_S = 0.01  # a stream's text at most this often, by default (app.py): below a 60 Hz frame
DEFAULT_MAX_QUEUE = 256  # requests that may wait past the engine's batch (admission.py); 0: no bound
