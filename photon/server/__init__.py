"""OpenAI-compatible HTTP server: `photon serve` (see photon/server/app.py for the routes)."""
