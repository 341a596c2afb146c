"""`specchat serve`: the engine behind an OpenAI-compatible HTTP endpoint (docs/serve.md).

protocol.py turns request bodies into the engine's settings, responses.py its results into OpenAI's JSON; app.py
holds the routes and hands each request's events from the engine's thread to its handler; metrics.py writes /metrics;
stopping.py ends the answers in flight when the server stops.
"""

STREAM_INTERVAL_S = 0.01  # a stream's text at most this often, by default (app.py): below a 60 Hz frame
