"""OpenAI's API over the same request path as TGI's: `schema` (bodies, OpenAI's own rules, conversion
into the frontend's request), `render` (response shapes), `routes` (and `routes.install`, which mounts
them with Responses and the LoRA routes), `error_shape` (OpenAI's error shape under /v1/)."""
