"""/v1/rerank (SGLang's and Cohere's shape), served by cross-encoder rerankers."""
