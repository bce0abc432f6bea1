"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}."""
