"""Datasets and the weights organizers upload: chunked uploads, sharding, tokenizers, images, pretrained weights.

Below ``campaigns``: a campaign trains on a dataset (and may start from
pretrained weights), and nothing here knows about campaigns.
"""
