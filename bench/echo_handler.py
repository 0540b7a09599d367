"""The cheapest possible TorchServe handler: a constant small JSON answer per request.

benchmark.py serves it with the DLRM's own TorchServe settings to measure TorchServe's ceiling,
so the DLRM handler's overhead above TorchServe's own is visible as a ratio.
"""

ANSWER = b'{"scores":[0.5]}'


class EchoHandler:
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        for i in range(len(data)):
            context.set_response_content_type(i, "application/json")
        return [ANSWER] * len(data)
