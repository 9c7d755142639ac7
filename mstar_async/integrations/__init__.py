"""Bridges from mstar_async to other frameworks; each one imports its framework lazily.

- ``mstar_async.integrations.pipecat``: ``MstarTTSService``, a Pipecat TTS service that speaks
  through an in-process ``Runtime`` (install ``mstar-async[voice]``).
"""
