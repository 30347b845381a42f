"""The types that cross a boundary: per-request sampling (sampling_params), the OpenAI API
(openai_api), router <-> target (generation), target <-> draft (draft, and draft_channel, its
socket data plane)."""
