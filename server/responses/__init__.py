"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions path: ``protocol`` (request, Response
object, stream events), ``convert`` (input items → chat), ``stream`` (``ResponseStream``), ``serving``
(``ResponsesServing``), and stored responses: ``store`` (``ResponseStore``) and ``retrieval``
(``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``, ``…/input_items``)."""
