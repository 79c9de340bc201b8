"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the chat completions path: ``protocol``
(request, Response object, stream events), ``convert`` (input items → chat), ``stream`` (``ResponseStream``) and
``serving`` (``ResponsesServing``)."""
