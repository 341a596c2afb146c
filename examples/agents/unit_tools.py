"""User tools for unit_convert.toml: the signature and docstring of each @tool function become its schema."""

from typing import Literal

from specchat.agent import tool

METRES = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}
Unit = Literal["m", "km", "mi", "ft"]


@tool
def convert_length(value: float, from_unit: Unit, to_unit: Unit) -> str:
    """Convert a length between metres, kilometres, miles and feet.

    Args:
        value: The length to convert.
        from_unit: The unit of value: m (metres), km (kilometres), mi (miles) or ft (feet).
        to_unit: The unit to convert to: m, km, mi or ft.
    """
    return f"{value * METRES[from_unit] / METRES[to_unit]:.4g} {to_unit}"


@tool
def convert_temperature(value: float, to_unit: Literal["C", "F"]) -> str:
    """Convert a temperature between Celsius and Fahrenheit.

    Args:
        value: The temperature, in the other unit than to_unit.
        to_unit: The unit to convert to: C (Celsius) or F (Fahrenheit).
    """
    converted = (value - 32) * 5 / 9 if to_unit == "C" else value * 9 / 5 + 32
    return f"{converted:.1f} {to_unit}"
