"""The structure a Kubeflow PyTorchJob (kubeflow.org/v1) must have, as a JSON Schema (draft 7).

An excerpt of the CRD's openAPIV3Schema (kubeflow/training-operator,
manifests/base/crds/kubeflow.org_pytorchjobs.yaml): the fields a launcher
renders, with their types, `required` lists and the Quantity pattern, plus the
rules the operator's validation enforces on top (replica types Master/Worker,
exactly one Master, a container named `pytorch` with an image, restart policies).
Unknown fields are refused where the CRD lists every field, so a typo fails
here instead of being pruned silently by the API server.
"""

from __future__ import annotations

from typing import Any

from tasks.config.cluster import K8S_QUANTITY_PATTERN  # the config checks cpu/memory with the same pattern at load

_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": K8S_QUANTITY_PATTERN}]}
_RESOURCE_LIST = {"type": "object", "additionalProperties": _QUANTITY}
_DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}

_CONTAINER = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _DNS_LABEL,
        "image": {"type": "string", "minLength": 1},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}, "value": {"type": "string"},
                           "valueFrom": {"type": "object", "properties": {"secretKeyRef": {
                               "type": "object", "required": ["key"],
                               "properties": {"name": {"type": "string"}, "key": {"type": "string", "minLength": 1},
                                              "optional": {"type": "boolean"}}},
                               "fieldRef": {"type": "object", "required": ["fieldPath"],
                                            "properties": {"fieldPath": {"type": "string", "minLength": 1},
                                                           "apiVersion": {"type": "string"}}}}}}}},
        "ports": {"type": "array", "items": {
            "type": "object", "required": ["containerPort"],
            "properties": {"containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                           "name": {"type": "string", "maxLength": 15}}}},
        "resources": {"type": "object", "properties": {"limits": _RESOURCE_LIST, "requests": _RESOURCE_LIST}},
        "volumeMounts": {"type": "array", "items": {
            "type": "object", "required": ["mountPath", "name"],
            "properties": {"mountPath": {"type": "string", "pattern": "^/"}, "name": {"type": "string"},
                           "readOnly": {"type": "boolean"}}}},
    },
}

_VOLUME = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _DNS_LABEL,
        "hostPath": {"type": "object", "required": ["path"],
                     "properties": {"path": {"type": "string"}, "type": {"type": "string", "enum": [
                         "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                         "BlockDevice"]}}},
        "persistentVolumeClaim": {"type": "object", "required": ["claimName"],
                                  "properties": {"claimName": {"type": "string", "minLength": 1},
                                                 "readOnly": {"type": "boolean"}}},
        "emptyDir": {"type": "object", "properties": {"medium": {"type": "string"}, "sizeLimit": _QUANTITY}},
    },
}

_POD_TEMPLATE = {
    "type": "object",
    "properties": {
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {"type": "array", "minItems": 1, "items": _CONTAINER,
                               # operator rule: the training container is the one named "pytorch", with an image
                               "contains": {"type": "object", "required": ["name", "image"],
                                            "properties": {"name": {"const": "pytorch"}}}},
                "initContainers": {"type": "array", "items": _CONTAINER},
                "volumes": {"type": "array", "items": _VOLUME},
                "restartPolicy": {"type": "string", "enum": ["Always", "OnFailure", "Never"]},
                "serviceAccountName": {"type": "string"},
            },
        },
    },
    "required": ["spec"],
}

_REPLICA_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
        "restartPolicy": {"type": "string", "enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": _POD_TEMPLATE,
    },
}

PYTORCHJOB_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "PyTorchJob (kubeflow.org/v1)",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": _DNS_LABEL,
                "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["Master"],
                    "properties": {
                        "Master": {"allOf": [_REPLICA_SPEC, {"properties": {"replicas": {"const": 1}}}]},
                        "Worker": _REPLICA_SPEC,
                    },
                },
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"type": "string", "enum": ["All", "Running", "None"]},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                        "suspend": {"type": "boolean"},
                        "schedulingPolicy": {"type": "object"},
                    },
                },
                "elasticPolicy": {"type": "object"},
                "nprocPerNode": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            },
        },
    },
}
