"""`dflash-mlx serve`: an OpenAI-compatible HTTP API on the speculative engine.

protocol.py reads and checks requests and shapes the JSON answers; text.py turns the token
stream into text (stop strings, the thinking split); sessions.py keeps cached prompt prefixes
between requests; worker.py owns the model and runs one generation at a time from a queue;
http.py is the HTTP layer (the standard library's server, as mlx-lm's own server uses).
"""
