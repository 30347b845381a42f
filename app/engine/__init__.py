"""The engine: the step loop (spec_engine), its thread beside the event loop (loop), output
text and stops (detokenizer), acceptance counting (acceptance), and a one-request helper
(generate)."""
