"""Qualified names of modules and parameters, for the collectors that name what they trace.

torch's global registration hooks report each submodule as it is assigned to a parent and each
parameter as it is registered on a module. `ModuleNames` keeps, weakly, the (parent, attribute) of
each, so a module or parameter is later named by its dotted path from the outermost module seen:
`tables.a` for `model.tables = nn.ModuleDict({"a": ...})`, `top.0.weight` for the weight of the
first layer of `model.top = nn.Sequential(...)`. A DistributedDataParallel wrapper adds no
`module.` to the path, so a name is the same at world size 1 and under DDP, and is the one the
unwrapped model's `named_parameters()` gives. A name is fixed the first time it is asked for.

What was registered before the hooks were, or sits in no module, gets a fallback name numbered from
0 in first-ask order: `f"{type(module).__name__}_{k}"` for a module, `param_{k}` for a parameter.

    names = ModuleNames()
    hooks = [register_module_module_registration_hook(names.on_module),
             register_module_parameter_registration_hook(names.on_parameter)]
    ...
    names.module_name(table), names.parameter_name(param)
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary


_REPLICATING = {"DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule"}  # by name: no FSDP import


class ModuleNames:
    """Qualified names of modules and parameters, from the registrations seen as they are assigned."""

    def __init__(self) -> None:
        self._parents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # child -> (ref(parent), attr)
        self._owners = WeakIdKeyDictionary()  # parameter -> (ref(module), attr), the first registration
        self._module_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> name, once asked
        self._parameter_names = WeakIdKeyDictionary()  # parameter -> name, once asked
        self._unnamed_modules = 0
        self._unnamed_parameters = 0

    def on_module(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        """A module registration hook: returns None, so the child is registered unchanged."""
        if child is not None:
            self._parents[child] = (weakref.ref(parent), attr)

    def on_parameter(self, module: nn.Module, attr: str, param: nn.Parameter | None) -> None:
        """A parameter registration hook: returns None, so the parameter is registered unchanged. A
        parameter shared by several modules keeps its first registration, as named_parameters() does."""
        if param is not None and param not in self._owners:
            self._owners[param] = (weakref.ref(module), attr)

    def module_name(self, module: nn.Module) -> str:
        name = self._module_names.get(module)
        if name is None:
            path = self._path(module)
            if not path:
                path = [f"{type(module).__name__}_{self._unnamed_modules}"]
                self._unnamed_modules += 1
            name = self._module_names[module] = ".".join(path)
        return name

    def parameter_name(self, param: nn.Parameter) -> str:
        name = self._parameter_names.get(param)
        if name is None:
            module, attr = self._owners.get(param, (lambda: None, ""))
            module = module()
            if module is None:
                name = f"param_{self._unnamed_parameters}"
                self._unnamed_parameters += 1
            else:
                name = ".".join([*self._path(module), attr])
            self._parameter_names[param] = name
        return name

    def is_replicated(self, module: nn.Module) -> bool:
        """Whether `module` is, or sits inside, a DistributedDataParallel or FSDP model (FSDP2's
        `fully_shard` too): a data-parallel replica of the same module on every rank."""
        node, seen = module, set()
        while node is not None and id(node) not in seen:
            if any(cls.__name__ in _REPLICATING for cls in type(node).__mro__):
                return True
            seen.add(id(node))
            parent = self._parents.get(node)
            node = parent[0]() if parent else None
        return False

    def _path(self, module: nn.Module) -> list[str]:
        """The attribute names from the outermost known ancestor down to `module` ([] if none)."""
        attrs: list[str] = []
        seen = {id(module)}
        node = module
        while node in self._parents:
            parent, attr = self._parents[node]
            node = parent()
            if node is None or id(node) in seen:  # parent collected, or a cycle
                break
            seen.add(id(node))
            if not (attr == "module" and isinstance(node, DistributedDataParallel)):
                attrs.append(attr)
        return attrs[::-1]
